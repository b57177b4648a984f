"""A bank of E experts with one FFN family's structure, weights stacked on a leading expert axis.

    fc1 -> [norm] -> act -> dropout -> [norm | grn] -> fc2 -> dropout        (plain FFN, timm's order)
    fc1 -> split (a, b) -> act(a) * b  or  a * act(b) -> [norm] -> ... -> fc2  (gated, GLU / SwiGLU)

Weights are stacked (`fc1.weight: [E, H, C]`) and only ever used through batched ops (`ops/expert_autograd.py`),
whose backward writes one stacked gradient in the weights' layout (indexing `weight[e]` per expert would allocate
a full-size gradient per expert). Routing hands the bank one description of its rows (`steps.rows.RoutedRows`:
each row's item and gate, the experts' segments, the rows a capacity dropped, each item's k rows, and how the call
runs); the bank's `transport` takes them to the ranks that hold their experts (this bank in one process,
`steps/transport.py`), and an expert step runs them, all steps the same function (their table: `steps/`).
`steps.choose` picks the step once per call: the one `steps.set_expert_step` forced, or under "auto" (the
default) the rule's (`steps/rule.py`) for the call's mode, the dtype, sizes and counts:

    grouped_mm  `F.grouped_mm` over the jagged segments, no host sync
    padded      rows scattered into [E, max count, C] and two `bmm`s
    loop        each expert's whole FFN on its contiguous segment in turn, its hidden activations in cache
                (under autograd, a small graph per segment); the only step for GRN experts
    triton      forced only (never "auto": slower than grouped_mm in training on an H200, docs/gpu.md): Triton
                kernels that gather the rows in fc1's loads and put the bias, activation and gate in the
                epilogues, no host sync (`ops/scattered.py`); with `combine`'s `position`, the gather and the
                combine are in the kernels too. Plain or GLU experts with GELU or SiLU, no inner norm, no dropout
                while training; on a GPU, or on CPU under TRITON_INTERPRET=1. Where it cannot run, forcing it
                raises, saying why, rather than run another step. (As for every forced step, Soft MoE's equal
                segments take their two `bmm` on the sync-free path.)

The steps use the bank through its declared surface (`steps.bank.ExpertBank`): `params`, `ffn`, `stacked`,
`run_local`, `run_slots`, `step_combines` and a few attributes.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .ops.activations import GluOrder
from .ops.expert_autograd import ExpertLinear
from .ops.mode import Mode
from .routing import at_least_fp32
from .steps import STEPS, ChoosesStep, choose
from .steps.base import combined, gathered
from .steps.rows import RoutedRows, Segments
from .steps.transport import LOCAL

InnerNorm = Literal["none", "layernorm", "layernorm_before_act", "grn"]


class StackedLinear(nn.Module):
    """E independent linear maps `in_features -> out_features`: weight [E, out, in], bias [E, out]."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # timm's init, trunc_normal_(std=0.02) truncated at +-2 (100 sigma), is this normal in distribution;
        # normal_ is twice as fast, which matters for billions of expert weights
        nn.init.normal_(self.weight, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (f"experts={self.weight.shape[0]}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class StackedNorm(nn.Module):
    """Per-expert affine parameters of a norm over the hidden units: weight, bias [E, H]."""

    def __init__(self, num_experts: int, features: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_experts, features))
        self.bias = nn.Parameter(torch.zeros(num_experts, features))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)


class Experts(ChoosesStep, nn.Module):
    """E FFN experts applied to contiguous per-expert segments of routed items.

    Args:
        num_experts: E.
        in_features / hidden / out_features: C -> H -> C' widths of one expert (H after gating).
        act: the FFN's activation module (shared; activations hold no parameters).
        glu: None for a plain FFN, else which half of fc1's 2H outputs goes through `act` (the GLU order).
        inner_norm: the FFN's norm between fc1 and fc2, if any ("grn": ConvNeXt-V2's global response
            norm, computed per image over the items of that image routed to the expert).
        bias: whether fc1 / fc2 have biases.
        drop: dropout after the activation and after fc2.
        clamped: the projections clamp their inputs and outputs (Gemma 4's clippable linears): a buffer
            `clamp` [3, 4] holds (input min, input max, output min, output max) of fc1 (its gate half under
            a GLU), of fc1's other half and of fc2, the same for every expert (constants of the dense FFN).
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        hidden: int,
        out_features: int,
        *,
        act: nn.Module,
        glu: GluOrder | None = None,
        inner_norm: InnerNorm = "none",
        norm_eps: float = 1e-6,
        bias: tuple[bool, bool] = (True, True),
        drop: tuple[float, float] = (0.0, 0.0),
        clamped: bool = False,
    ):
        super().__init__()
        self.num_experts, self.hidden = num_experts, hidden
        self.glu, self.inner_norm, self.drop = glu, inner_norm, drop
        self.fc1 = StackedLinear(num_experts, in_features, hidden * (2 if glu else 1), bias=bias[0])
        self.act = act
        self.norm = StackedNorm(num_experts, hidden, norm_eps) if inner_norm != "none" else None
        self.fc2 = StackedLinear(num_experts, hidden, out_features, bias=bias[1])
        self.register_buffer("clamp", torch.empty(3, 4) if clamped else None)
        self.step = "auto"  # the expert step: "auto" (the rule) or one forced by `steps.set_expert_step`
        self.transport = LOCAL  # where the rows go: this bank (`steps.transport.Local`), or over ranks (`AllToAll`)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The bank's own state (its projections reset themselves): unbounded clamps, as a fresh Gemma 4
        clippable linear has until a checkpoint gives it bounds."""
        if self.clamp is not None:
            self.clamp.copy_(torch.tensor([-math.inf, math.inf, -math.inf, math.inf]).expand(3, 4))

    @property
    def needs_groups(self) -> bool:
        """Whether forward needs each row's image index (GRN normalizes per image)."""
        return self.inner_norm == "grn"

    @property
    def local_experts(self) -> int:
        """Experts stacked in this bank's weights: all E, or this rank's E/W under expert parallelism."""
        return self.fc1.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.fc1.in_features

    @property
    def out_features(self) -> int:
        return self.fc2.out_features

    def macs_per_item(self) -> int:
        """MACs of one expert on one item, in fvcore's convention: fc1 + fc2 (+ 5 per unit for an inner
        LayerNorm, as fvcore counts affine norms); activations, gating and GRN are elementwise (not counted)."""
        norm = 5 * self.hidden if self.inner_norm in ("layernorm", "layernorm_before_act") else 0
        return self.fc1.in_features * self.fc1.out_features + self.fc2.in_features * self.fc2.out_features + norm

    @property
    def widths(self) -> tuple[int, ...]:
        """Every row width the FFN's matmuls read: C, fc1's outputs, H, C' (grouped_mm needs 16-byte strides)."""
        return self.in_features, self.fc1.out_features, self.hidden, self.out_features

    @property
    def clamped(self) -> bool:
        """Whether the projections clamp their inputs and outputs (`clamp`)."""
        return self.clamp is not None

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.fc1.weight.dtype

    def forward(self, x: torch.Tensor, counts: torch.Tensor, groups: torch.Tensor | None = None, *,
                dropped: bool = False, mode: Mode | None = None) -> torch.Tensor:
        """Run expert e on rows `x[offset_e : offset_e + counts[e]]`.

        Args:
            x: [S, C] routed items sorted by expert.
            counts: [E] items per expert (summing to S, or less where `dropped`), on x's device.
            groups: [S] image index of each row; needed only by the "grn" inner norm.
            dropped: rows past sum(counts) follow (pairs a capacity dropped: `steps.rows.Segments`); their outputs
                are 0.
            mode: how the layer call runs (`ops.mode.Mode`); None: a call that starts here.
        Returns:
            [S, C'] expert outputs in the same order.
        """
        mode = mode if mode is not None else Mode.of(x, self)
        return self.transport.run(self, x, Segments(counts, dropped), groups, mode)

    def run_local(self, x: torch.Tensor, segments: Segments, groups: torch.Tensor | None, mode: Mode,
                  step: str | None = None) -> torch.Tensor:
        """Rows x [S, C] sorted by this bank's own experts through `step` (None: the one `steps.choose` picks for
        them), a step of the table (`steps.STEPS`). A step that reads the counts on the host anyway runs the
        segments' rows, and the dropped rows after them get 0."""
        step = step or choose(self, x.shape[0], x, segments.counts, mode)
        runner = STEPS[step]
        if segments.dropped and not runner.static_shapes:
            kept = segments.kept(x.shape[0])
            out = runner.run(self, x[:kept], Segments(segments.counts), groups[:kept] if groups is not None else None,
                             mode)
            return torch.cat([out, out.new_zeros(x.shape[0] - kept, out.shape[-1])])
        return runner.run(self, x, segments, groups, mode)

    def strategy(self, x: torch.Tensor, counts: torch.Tensor) -> str:
        """The expert step `steps.choose` picks for rows `x` (`counts` per expert) in a call that starts here."""
        return choose(self, x.shape[0], x, counts, Mode.of(x, self))

    def combine(self, items: torch.Tensor, rows: RoutedRows, groups: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' part of an MoE layer: y[t] = sum over the rows r of item t of
        weights[r] * expert_r(items[t]); 0 for an item in no row.

        Args:
            items: [T, C] the layer's items.
            rows: the routed rows (`steps.rows.RoutedRows`): each row's item and gate, the experts' segments, each
                item's k rows where known, and how the layer call runs (`mode`).
            groups: [T] image index of each item; needed only by the "grn" inner norm.
        Returns:
            [T, C'].

        The step is chosen once, here, and its own `combine` runs where it has one: on the sync-free path with
        `position`, the grouped (or forced triton) step with its gather and combine around its matmuls; where
        autograd records nothing, the loop, each expert's segment gathered, run and scaled in turn while it is in
        cache. Otherwise the bank gathers every row, the transport runs the step on them (on the ranks that hold
        their experts, under expert parallelism), and each item gathers and sums its rows' scaled outputs.
        """
        step = choose(self, rows.item.shape[0], items, rows.counts, rows.mode)
        out = STEPS[step].combine(self, items, rows, groups)
        if out is not None:
            return out
        out = self.transport.run(self, gathered(items, rows), rows.segments,
                                 groups.index_select(0, rows.item) if groups is not None else None, rows.mode, step)
        return combined(out, rows, items.shape[0])

    def step_combines(self, rows: RoutedRows) -> bool:
        """Whether a step may gather and combine the pairs around its matmuls: each item's k rows are known
        (`position`), the rows stay on this rank, and no step of the FFN needs the images or clamps."""
        return rows.position is not None and self.transport.local and not self.needs_groups and self.clamp is None

    @property
    def first(self) -> int:
        """The global index of this bank's first expert (0 but under expert parallelism)."""
        return self.transport.first

    def batched(self, x: torch.Tensor, mode: Mode | None = None) -> torch.Tensor:
        """Expert e on every row of x[e]: x [E, M, C] -> [E, M, C'] (Soft MoE's slots; not for GRN experts),
        on the ranks that hold the experts (`transport`), in a call that runs as `mode` says (None: one that
        starts here)."""
        return self.transport.batched(self, x, mode if mode is not None else Mode.of(x, self))

    def run_slots(self, x: torch.Tensor, mode: Mode) -> torch.Tensor:
        """The experts stacked here on x [local_experts, M, C], M rows each, by the forced step or the one
        `rule.equal_segments_step` picks: padded has nothing to pad, so it is two bmm on x itself; the loop
        on CPU from 128 rows per expert in forward, 512 under autograd. Sync-free (a GPU, export, compile):
        the bmm."""
        experts, rows, dim = x.shape
        if mode.sync_free:  # no choice made on the sizes, no host sync
            return self.stacked(x, mode)
        flat = x.reshape(experts * rows, dim)
        counts = torch.full((experts,), rows, dtype=torch.long, device=x.device)
        step = choose(self, flat.shape[0], flat, counts, mode, equal=True)
        if step == "padded":
            return self.stacked(x, mode)
        return self.run_local(flat, Segments(counts), None, mode, step).view(experts, rows, -1)

    def stacked(self, x: torch.Tensor, mode: Mode) -> torch.Tensor:
        """The experts stacked here (`local_experts`) on x [local_experts, M, C], as batched matmuls."""
        w1, b1, norm_w, norm_b, w2, b2 = self.params()
        norm = [p.unsqueeze(1) if p is not None else None for p in (norm_w, norm_b)]  # [E, 1, H]: per row

        def linear(h, weight, bias):  # every expert at once
            return ExpertLinear.apply(h, weight, bias, None, None, False, mode.sync_free, mode.traced)

        return self.ffn(x, [w1, b1, *norm, w2, b2], None, linear=linear)

    def forward_all(self, x: torch.Tensor, groups: torch.Tensor | None = None) -> torch.Tensor:
        """Every expert on every row, summed: the always-active shared experts. x: [T, C] -> [T, C']."""
        params = [p.unbind(0) if p is not None else None for p in self.params()]
        out = None
        for expert in range(self.num_experts):
            y = self.ffn(x, [p[expert] if p is not None else None for p in params], groups)
            out = y if out is None else out + y
        return out

    def params(self) -> list[torch.Tensor | None]:
        """fc1's weight and bias, the inner norm's, fc2's (None where absent), as the transport hands them to the
        steps (under expert parallelism, with their gradients scaled: `transport.AllToAll.parameters`)."""
        norm = self.norm
        return self.transport.parameters([
            self.fc1.weight,
            self.fc1.bias,
            norm.weight if norm is not None else None,
            norm.bias if norm is not None else None,
            self.fc2.weight,
            self.fc2.bias,
        ])

    def ffn(self, x: torch.Tensor, params: list, groups: torch.Tensor | None, linear=None,
            activated=None) -> torch.Tensor:
        """One expert on rows x [S, C] (params of one expert), or every expert on a padded batch [E, M, C]
        (stacked params, norm params [E, 1, H], `linear` batched); `linear` overrides how fc1 / fc2 are applied,
        `activated` how fc1 and the activation (with the GLU's gating) are (the grouped step's `bias_act`)."""
        w1, b1, norm_w, norm_b, w2, b2 = params
        linear = F.linear if linear is None else linear  # not `or`: torch 2.11's Dynamo cannot test a function
        if activated is not None:
            h = activated(x, w1, b1)
        else:
            h = self._activated(linear, x, w1, b1, norm_w, norm_b)
        h = F.dropout(h, self.drop[0], self.training)  # before the inner norm, as timm's FFNs drop (drop1, norm)
        if self.inner_norm == "layernorm":
            h = _layer_norm(h, norm_w, norm_b, self.norm.eps)
        elif self.inner_norm == "grn":
            h = _global_response_norm(h, norm_w, norm_b, self.norm.eps, groups)
        out = linear(h, w2, b2) if self.clamp is None else _clamped_linear(linear, h, w2, b2, self.clamp[2])
        return F.dropout(out, self.drop[1], self.training)

    def _activated(self, linear, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
                   norm_w: torch.Tensor | None, norm_b: torch.Tensor | None) -> torch.Tensor:
        """fc1, then the activation (GLU: and the gating; "layernorm_before_act": the norm first)."""
        h = linear(x, w1, b1) if self.clamp is None else self._clamped_fc1(linear, x, w1, b1)
        if self.glu is not None:
            a, b = h.chunk(2, dim=-1)
            if h.requires_grad:
                h = self.act(a) * b if self.glu == "act_first" else a * self.act(b)
            else:  # nothing recorded: the product into act's fresh output, one [rows, H] tensor fewer
                h = self.act(a).mul_(b) if self.glu == "act_first" else self.act(b).mul_(a)
        elif self.inner_norm == "layernorm_before_act":
            h = self.act(_layer_norm(h, norm_w, norm_b, self.norm.eps))
        else:
            h = self.act(h)
        return h

    def _clamped_fc1(self, linear, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None) -> torch.Tensor:
        """fc1 with clamped input and output; under a GLU each half with its own bounds (`clamp` rows 0, 1)."""
        if self.glu is None:
            return _clamped_linear(linear, x, w1, b1, self.clamp[0])
        half = self.hidden
        return torch.cat([_clamped_linear(linear, x, w1.narrow(-2, start, half),
                                          None if b1 is None else b1.narrow(-1, start, half), self.clamp[row])
                          for row, start in enumerate((0, half))], dim=-1)


def _clamped_linear(linear, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    bounds: torch.Tensor) -> torch.Tensor:
    """`linear` with its input clamped to bounds[0:2] and its output to bounds[2:4] (`Experts.clamp`)."""
    return linear(x.clamp(bounds[0], bounds[1]), weight, bias).clamp(bounds[2], bounds[3])


def _layer_norm(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last axis with affine params of one expert ([H]) or broadcast per row ([..., H])."""
    if weight.dim() == 1:
        return F.layer_norm(h, h.shape[-1:], weight, bias, eps)
    return torch.addcmul(bias, F.layer_norm(h, h.shape[-1:], eps=eps), weight)


def _global_response_norm(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                          groups: torch.Tensor | None) -> torch.Tensor:
    """ConvNeXt-V2 GRN (Woo et al. 2023) over the rows of each image: h + weight * (h * Nx) + bias.

    Gx is the L2 norm over an image's positions per channel, Nx = Gx / (mean_channels(Gx) + eps). h: [S, H].
    """
    if groups is None:
        groups = h.new_zeros(h.shape[0], dtype=torch.long)
    count = int(groups.max()) + 1 if groups.numel() else 0
    sq = h.new_zeros(count, h.shape[1]).index_add_(0, groups, at_least_fp32(h).pow(2).to(h.dtype))
    gx = sq.sqrt()
    nx = gx / (gx.mean(dim=-1, keepdim=True) + eps)
    return h + torch.addcmul(bias, weight, h * nx[groups])

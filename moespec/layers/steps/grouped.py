"""The grouped_mm step: grouped matmuls over the jagged per-expert segments (`ops.grouped.segment_mm`, torch's
`F.grouped_mm`), static shapes and no host sync: the step of every device but the CPU and of torch.compile."""

from __future__ import annotations

import torch

from ..ops.activations import activation
from ..ops.bias_act import bias_act
from ..ops.expert_autograd import ExpertLinear, GatherPairs
from ..ops.mode import Mode
from ..ops.pairs import combine
from .base import ExpertStep
from .rows import RoutedRows, Segments


class GroupedStep(ExpertStep):
    name = "grouped_mm"
    static_shapes = True

    def run(self, bank, x: torch.Tensor, segments: Segments, groups: torch.Tensor | None, mode: Mode) -> torch.Tensor:
        """Grouped matmuls over the jagged segments (`ops.grouped.segment_mm`): static shapes, and the offsets stay
        on the device (no host sync). Under autocast the rows and weights go in autocast's dtype, as they would
        through `F.linear` (autocast does not cast a custom op's inputs)."""
        expert = segments.expert_of_rows(x.shape[0])
        w1, b1, norm_w, norm_b, w2, b2 = bank.params()
        cast = mode.autocast
        if cast is not None:
            x, w1, b1, w2, b2 = [None if t is None else t.to(cast) for t in (x, w1, b1, w2, b2)]
        norm = [segments.per_row(p, expert) for p in (norm_w, norm_b)]
        return bank.ffn(x, [w1, b1, *norm, w2, b2], None, linear=_segment_linear(segments, expert, mode))

    def combine(self, bank, items: torch.Tensor, rows: RoutedRows, groups: torch.Tensor | None) -> torch.Tensor | None:
        """`combine` on the sync-free path, when each item has k rows (`position`; not for a bank whose rows
        travel to other ranks, `ExpertBank.step_combines`): its passes over the rows are the gather, fc1's grouped
        matmul without bias, fc1's bias with the activation in one op (`bias_act`, where `_bias_act_name` allows;
        elsewhere fc1's bias per row and the plain ops), fc2's grouped matmul and the combine. No copy of the
        weight bank: each weight is cast once, to autocast's dtype, and read by one grouped matmul in forward
        and one per gradient in backward. fc2's bias is folded into the combine (`CombinePairs`; not under
        output dropout, which it precedes). The gather and the combine go back by gathers (`GatherPairs`,
        `CombinePairs`), not atomic scatter-adds. On CPU eagerly the bank gathers and combines
        (`base.gathered`, `base.combined`)."""
        mode = rows.mode
        if not mode.sync_free or not bank.step_combines(rows):
            return None
        segments, position = rows.segments, rows.position
        expert = segments.expert_of_rows(rows.item.shape[0])
        w1, b1, norm_w, norm_b, w2, b2 = bank.params()
        dtype = mode.autocast or w1.dtype
        items, w1 = items.to(dtype), w1.to(dtype)
        fold = b2 is not None and not (bank.training and bank.drop[1] > 0)
        w2, b2 = w2.to(dtype), None if b2 is None else b2.to(dtype)
        x = GatherPairs.apply(items, rows.item, position, mode.sync_free)
        norm = [segments.per_row(p, expert) for p in (norm_w, norm_b)]
        linear = _segment_linear(segments, expert, mode)
        act = _bias_act_name(bank)
        activated = None if act is None else _bias_activated(linear, segments, expert, act, bank.glu, mode)
        if act is None and b1 is not None:  # the plain ops: the bias per row, in the matmuls' dtype
            b1 = b1.to(dtype)
        out = bank.ffn(x, [w1, b1, *norm, w2, None if fold else b2], None, linear=linear, activated=activated)
        gates, choices = rows.gates, rows.choices
        if gates is None:  # the pairs' gates in choice order (a capacity's dropped choices: 0)
            tokens, k = position.shape
            flat = position.reshape(-1)
            gates = rows.weights.index_select(0, flat).view(tokens, k)
            choices = expert.clamp(max=bank.local_experts - 1).index_select(0, flat).view(tokens, k)
        dtype = torch.promote_types(out.dtype, rows.weights.dtype)
        return combine(out, gates, position, dtype=dtype, experts=choices, bias=b2 if fold else None,
                       ends=segments.ends(), traced=mode.traced)


def _segment_linear(segments: Segments, expert: torch.Tensor, mode: Mode):
    offsets = segments.ends()

    def linear(h, weight, bias):
        return ExpertLinear.apply(h.to(weight.dtype), weight, bias, offsets, expert, segments.dropped, mode.sync_free,
                                  mode.traced)

    return linear


def _bias_act_name(bank) -> str | None:
    """`bias_act`'s name for the bank's activation where fc1's bias (if any) and the activation may run as one op
    after fc1: nothing clamps, no norm comes between fc1 and the activation, and the activation is
    GELU (erf) or SiLU (`ops.activations.activation`). Else None: the plain ops."""
    if bank.clamped or bank.inner_norm == "layernorm_before_act":
        return None
    return activation(bank.act)


def _bias_activated(linear, segments: Segments, expert: torch.Tensor, act: str, glu: str | None, mode: Mode):
    """fc1 as `linear` without its bias, then `bias_act`: the bias of each row's expert and the activation (GLU:
    and the gating) in one op."""
    offsets = segments.ends()

    def activated(x, weight, bias):
        return bias_act(linear(x, weight, None), bias, expert, offsets, act=act, glu=glu, traced=mode.traced)

    return activated

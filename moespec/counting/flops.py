"""FLOP counting with fvcore, in fvcore's convention: one fused multiply-add = one flop (we say MACs).

fvcore's default handles count linear / conv / matmul / einsum / norms; `FLOP_HANDLES` layers the ops it
misses on top, in one table. MoE layers are not traced: during counting each one is swapped for a
shape-only stand-in that records how many items it would route, and is costed analytically by
the layer's `activated_macs(items, images)` (gate, routed rows through their experts plus the weighted
combine, shared experts; Soft MoE: logits, dispatch, combine and slot FFNs), so the figure is the activated
cost under perfect balance and never depends on one input's random routing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

with warnings.catch_warnings():  # fvcore scripts a focal loss at import; torch warns that jit is deprecated
    warnings.simplefilter("ignore", FutureWarning)
    from fvcore.nn import FlopCountAnalysis
    from fvcore.nn.jit_handles import get_shape

from ..choices import ATTENTION_MATMULS, DISPATCH_FLOPS
from ..layers import MoELayer

FLOP_HANDLES: dict[str, Callable[[list[Any], list[Any]], int]] = {}
"""Op handles added to fvcore's defaults (op name -> fn(inputs, outputs) -> MACs)."""


def register_flop_handle(op: str) -> Callable[[Callable], Callable]:
    """Register the decorated `fn(inputs, outputs) -> MACs` as the counter of the TorchScript op `op`."""

    def wrap(handle: Callable) -> Callable:
        FLOP_HANDLES[op] = handle
        return handle

    return wrap


@register_flop_handle("aten::scaled_dot_product_attention")
def scaled_dot_product_attention_flop(inputs: list[Any], outputs: list[Any]) -> int:
    """QK^T and AV of `F.scaled_dot_product_attention`: B*H*N*M*Dk + B*H*N*M*Dv MACs.

    q: [..., N, Dk], k: [..., M, Dk], v: [..., M, Dv]; softmax and scaling are elementwise (not counted).
    """
    q, k, v = (get_shape(x) for x in inputs[:3])
    batch_heads = 1
    for size in q[:-2]:
        batch_heads *= size
    n, dk, m, dv = q[-2], q[-1], k[-2], v[-1]
    return batch_heads * n * m * (dk + dv)


@register_flop_handle("prim::PythonOp.ExpertLinear")
def expert_linear_flop(inputs: list[Any], outputs: list[Any]) -> int:
    """`ExpertLinear` (the experts' fc1 / fc2, padded or jagged): each row of x through its expert's [H, C]
    weight. x: [E, M, C] or [S, C], weight: [E, H, C] -> rows * C * H MACs (a padded row counts: it runs)."""
    x, weight = get_shape(inputs[0]), get_shape(inputs[1])
    rows = 1
    for size in x[:-1]:
        rows *= size
    return rows * x[-1] * weight[-2]


@register_flop_handle("prim::PythonOp.CombinePairs")
def combine_pairs_flop(inputs: list[Any], outputs: list[Any]) -> int:
    """`CombinePairs`: each expert output row [P, C'] times its gate, added into its item: P * C' MACs (the
    weighted combine that `MoE.activated_macs` counts)."""
    out = get_shape(inputs[0])
    return out[0] * out[-1]


def fvcore_handles() -> dict[str, Callable[[list[Any], list[Any]], int]]:
    """The op handles to add to fvcore's defaults when tracing a moespec model with fvcore yourself: the ops
    fvcore does not know (`F.scaled_dot_product_attention`) and moespec's expert steps, which run as autograd
    Functions (`prim::PythonOp.*`) that the trace does not look into. In eval, on the model of `create_model`:

        analysis = FlopCountAnalysis(model.eval(), x).set_op_handle(**moespec.fvcore_handles())
        analysis.total()  # executed MACs of this input: moespec stats' figure at batch 1, with no drops

    A copy: changing it changes nothing here."""
    return dict(FLOP_HANDLES)


MATMUL_LIKE = re.compile(r"mm|matmul|conv|einsum|linear|attention|bmm|baddbmm|addmv|dot|tensordot|bilinear")
"""Op names that carry matmul-like work: none of them may be left uncounted."""


@dataclass(frozen=True)
class MacCount:
    """MACs of one forward at batch 1, split into the traced backbone and the analytic MoE layers."""

    backbone: int  # everything fvcore traced (MoE layers excluded)
    moe_layers: dict[str, int]  # activated MACs per MoE layer
    moe_items: dict[str, int]  # items routed per MoE layer
    moe_images: dict[str, int]  # images (sequences) per MoE layer: 1 at batch 1
    unsupported: dict[str, int]  # ops fvcore saw but did not count, with their call counts
    modules: dict[str, int] = dataclasses.field(default_factory=dict)  # MACs of the modules asked for, by path

    @property
    def total(self) -> int:
        return self.backbone + sum(self.moe_layers.values())


def layer_macs(layer: MoELayer, items: int, images: int, dispatch_flops: str = "gather") -> int:
    """MACs of one MoE layer for `items` items in `images` images, with dispatch and combine costed the
    `dispatch_flops` way (`choices.DISPATCH_FLOPS`): `einsum` changes only the layers it applies to (a router
    with a capacity); the others cost the same either way."""
    if dispatch_flops not in DISPATCH_FLOPS:
        raise ValueError(f"dispatch_flops must be one of {', '.join(DISPATCH_FLOPS)}, not {dispatch_flops!r}")
    einsum = layer.einsum_macs(items, images) if dispatch_flops == "einsum" else None
    return layer.activated_macs(items, images) if einsum is None else einsum


def count_macs(model: nn.Module, input_size: tuple[int, int, int], *, dispatch_flops: str = "gather",
               attention_matmuls: str = "count", modules: Sequence[str] = ()) -> MacCount:
    """Count MACs of `model` on one image of `input_size` (eval mode). The trace runs the forward, so parameters
    need real tensors, though not real values: `create_weightless_backbone`'s zero-stride views will do.
    `dispatch_flops` and `attention_matmuls` are the counting conventions of `choices`; `skip` leaves out the
    QK^T and AV products of every attention, which runs as `F.scaled_dot_product_attention` for the count (timm's
    `fused_attn`), so that no attention computes them as plain matmuls that the count would keep. `modules`:
    paths of modules whose own MACs to report as well (`MacCount.modules`)."""
    if attention_matmuls not in ATTENTION_MATMULS:
        raise ValueError(f"attention_matmuls must be one of {', '.join(ATTENTION_MATMULS)}, not {attention_matmuls!r}")
    layers = {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}
    handles = dict(FLOP_HANDLES)
    if attention_matmuls == "skip":
        handles["aten::scaled_dot_product_attention"] = _no_macs
    was_training = model.training
    model.eval()
    try:
        # no_grad: counting never backpropagates, and autograd's bookkeeping during the trace costs memory
        # (ViT-H/14: +0.7 GiB peak over its 2.4 GiB of weights)
        with _shape_only(layers.values()), _hooks_kept(model), _fused_attention(model, attention_matmuls == "skip"), \
                warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # jit tracer chatter
            analysis = FlopCountAnalysis(model, torch.zeros(1, *input_size))
            analysis.set_op_handle(**handles)
            analysis.unsupported_ops_warnings(False)
            analysis.uncalled_modules_warnings(False)
            analysis.tracer_warnings("none")
            backbone = analysis.total()
            unsupported = dict(analysis.unsupported_ops())
            by_module = analysis.by_module() if modules else {}
    finally:
        model.train(was_training)
    items = {name: m.last_items for name, m in layers.items()}
    images = {name: m.last_images for name, m in layers.items()}
    macs = {name: layer_macs(m, items[name], images[name], dispatch_flops) for name, m in layers.items()}
    return MacCount(backbone, macs, items, images, unsupported, {path: by_module[path] for path in modules})


def _no_macs(inputs: list[Any], outputs: list[Any]) -> int:
    return 0


@contextlib.contextmanager
def _fused_attention(model: nn.Module, on: bool) -> Iterator[None]:
    """With `on`, every timm attention of `model` (a module with a `fused_attn` flag) runs through
    `F.scaled_dot_product_attention` while the context lasts: the same values, one op to count or skip."""
    flagged = [m for m in model.modules() if isinstance(getattr(m, "fused_attn", None), bool)] if on else []
    before = [m.fused_attn for m in flagged]
    for module in flagged:
        module.fused_attn = True
    try:
        yield
    finally:
        for module, value in zip(flagged, before, strict=True):
            module.fused_attn = value


@contextlib.contextmanager
def _shape_only(layers: Iterator[nn.Module]) -> Iterator[None]:
    """Swap each MoE layer's forward for one that runs its `pre` (traced and counted) and returns zeros of the
    output shape, recording its items."""

    def forward(self: nn.Module, x: torch.Tensor, *args) -> torch.Tensor:  # args: whole FFN copies' (feat_size)
        x = self.run_pre(x)  # a dense module: fvcore counts it with the backbone
        channels = x.shape[self.channels_dim]
        self.last_items, self.last_images = int(x.numel()) // int(channels), int(x.shape[0])
        shape = list(x.shape)
        shape[self.channels_dim] = getattr(self, "out_features", None) or self.experts.out_features
        return torch.zeros(shape, dtype=x.dtype, device=x.device)

    layers = list(layers)
    for layer in layers:
        layer.forward = types.MethodType(forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


@contextlib.contextmanager
def _hooks_kept(model: nn.Module) -> Iterator[None]:
    """The model's forward hooks as they were before the block, whatever happens in it: fvcore registers scope
    hooks on every module and removes them only when its trace succeeds, so a failed trace left them, and the
    model no longer pickled (its hooks are local classes)."""
    before = {name: (set(m._forward_pre_hooks), set(m._forward_hooks)) for name, m in model.named_modules()}
    try:
        yield
    finally:
        for name, module in model.named_modules():
            pre, post = before.get(name, (set(), set()))
            for added in set(module._forward_pre_hooks) - pre:  # as torch's RemovableHandle.remove() does
                for hooks in (module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs):
                    hooks.pop(added, None)
            for added in set(module._forward_hooks) - post:
                for hooks in (module._forward_hooks, module._forward_hooks_with_kwargs,
                              module._forward_hooks_always_called):
                    hooks.pop(added, None)

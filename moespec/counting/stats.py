"""Stats: total / activated parameters and MACs of a spec, and of its dense backbone for comparison.

Counting rules, as the papers count:
- parameters are counted from the built model, each shared tensor once, buffers never;
- activated parameters per routed item = everything outside MoE layers + routers + shared experts + the
  routed experts one item uses per MoE layer (`MoELayer.experts_per_item`: k for top-k);
- MACs follow fvcore (one multiply-add = one flop) at batch 1 and the spec's input size; MoE layers are
  costed as activated compute under perfect balance and no drops (see `flops.py`), from the same
  `experts_per_item`.

The backbone is built and traced once per spec: the dense figures come from it before the rewrite, the MoE
figures from the compiled model that shares its modules. No weight is allocated: the backbone's parameters are
zero-stride views of one zero (`create_weightless_backbone`; fvcore's trace needs real tensors, not real values)
and the MoE layers are built on the meta device, so a spec of billions of parameters costs its activations at
batch 1 and a passing copy of its largest weight. Nothing built is in a reference cycle (the compiler leaves
none), so all of it is freed as `stats` returns, without a garbage collection, and counting several specs in
one process peaks at the largest one. Records are data; the CLI renders them.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import asdict, dataclass, field
from typing import Callable

from pydantic import TypeAdapter, ValidationError
from torch import nn

from ..backbones import create_backbone, create_weightless_backbone
from ..choices import ATTENTION_MATMULS, DISPATCH_FLOPS
from ..compiler import compile_model, moe_layers
from ..errors import SpecError
from ..planning import (
    INPUT_SIZE_ERRORS,
    LayerPlan,
    Plan,
    input_refusal,
    input_size_error,
    items_problems,
    plan_for,
)
from ..spec import Spec
from .budget import refuse_uncountable
from .flops import MacCount, count_macs, layer_macs


@dataclass(frozen=True)
class LayerStats:
    """One MoE layer. `activated` says what one routed item is (a token / position here)."""

    path: str
    experts: int
    top_k: int
    shared_experts: int
    params: int  # router + shared + all routed experts
    routed_params: int  # all routed experts (the `experts` bank): what expert parallelism splits over ranks
    activated_params: int  # router + shared + top_k routed experts
    gmacs: float  # activated, per image
    activated: str = "per token"
    items: int = 0  # items routed per image
    executed_gmacs: float | None = None  # with a capacity factor: every expert padded to capacity
    # In eval mode, where the router's eval_top_k / eval_capacity_factor make it differ from training (else None):
    eval_top_k: int | None = None
    eval_activated_params: int | None = None
    eval_gmacs: float | None = None
    eval_executed_gmacs: float | None = None
    router: str = ""  # the router and its options, as `moespec plan` shows them (`topk/linear sigmoid scale=2.5`)


@dataclass(frozen=True)
class SpecStats:
    name: str
    spec: str  # the spec file, or "" for a spec built in Python
    backbone: str
    input_size: tuple[int, int, int]
    total_params: int
    activated_params: int
    dense_params: int
    gmacs: float  # activated, per image
    dense_gmacs: float
    moe_layers: int
    experts_total: int
    layers: list[LayerStats] = field(default_factory=list)
    eval_activated_params: int | None = None  # in eval mode, where some layer differs from training (else None)
    eval_gmacs: float | None = None
    dispatch_flops: str = "gather"  # the counting conventions of the MACs (`choices`)
    attention_matmuls: str = "count"

    def to_dict(self) -> dict:
        record = asdict(self)
        record["input_size"] = list(self.input_size)
        return record


def count_params(module: nn.Module) -> int:
    """Parameters of `module`, each shared tensor once, buffers not counted."""
    return sum(p.numel() for p in module.parameters())  # parameters() already yields each tensor once


def at_input_size(spec: Spec, input_size: tuple[int, int, int], option: str = "--input-size",
                  on_rebuild: Callable[[str], None] | None = None) -> Spec:
    """`spec` at another input size, given by `option` (the command line's `--input-size`). The size passes the
    checks of the spec's own `input_size` (its ranges here; the backbone's refusals in the plan), and a backbone
    built for one image size (a ViT's patch grid and position embedding, a Mixer's token MLPs) takes it as
    `img_size`, as timm's `create_model(..., img_size=...)`; `on_rebuild` is then told so, in a line."""
    input_size = _checked_size(input_size, option)
    update: dict = {"input_size": input_size}
    model_class = type(create_backbone(spec, device="meta"))
    if "img_size" in inspect.signature(model_class).parameters:
        channels, height, width = input_size
        kwargs = {**spec.backbone.kwargs, "img_size": height if height == width else [height, width]}
        if channels != 3 or "in_chans" in kwargs:
            kwargs["in_chans"] = channels
        update["backbone"] = spec.backbone.model_copy(update={"kwargs": kwargs})
    sized = spec.model_copy(update=update)
    refusal = input_refusal(create_backbone(sized, device="meta"), input_size)  # the plan's check, named here
    if refusal is not None:
        raise SpecError(f"{option} {' '.join(map(str, input_size))}: the model cannot take it: {refusal}")
    note = _rebuilt_note(spec, sized, option)
    if note is not None and on_rebuild is not None:
        on_rebuild(note)
    return sized


def _checked_size(input_size: tuple[int, int, int], option: str) -> tuple[int, int, int]:
    """`input_size` validated as the spec's `input_size` field is (1 to the limits of channels and sides); a
    SpecError naming `option` otherwise."""
    try:
        return TypeAdapter(Spec.model_fields["input_size"].annotation).validate_python(list(input_size))
    except ValidationError as error:
        first = error.errors()[0]
        which = ("channels", "height", "width")[first["loc"][0]] if first["loc"] else "size"
        message = first["msg"].removeprefix("Value error, ")
        raise SpecError(f"{option} {' '.join(map(str, input_size))}: {which}: {message[:1].lower()}{message[1:]} "
                        f"(as the spec's input_size)") from None


def _rebuilt_note(spec: Spec, rebuilt: Spec, option: str) -> str | None:
    """What `at_input_size` changed in the backbone, in a line for stderr; None when it is built as the spec
    says (a model that takes any input size)."""
    before, after = spec.backbone.kwargs, rebuilt.backbone.kwargs
    changed = [key for key in ("img_size", "in_chans") if after.get(key) != before.get(key)]
    if not changed:
        return None
    now = ", ".join(f"{key} {after[key]}" for key in changed)
    was = ", ".join(f"{key} {before[key]}" if key in before else f"timm's default {key}" for key in changed)
    return (f"{spec.backbone.model} rebuilt at {now} for {option} {' '.join(map(str, rebuilt.input_size))} (the spec "
            f"builds it at {was})")


def stats(spec: Spec, *, input_size: tuple[int, int, int] | None = None, dispatch_flops: str = "gather",
          attention_matmuls: str = "count") -> SpecStats:
    """Parameter and MAC counts of `spec` (at `input_size`, default the spec's) and of its dense backbone.
    `dispatch_flops` (`gather` | `einsum`) and `attention_matmuls` (`count` | `skip`) choose how the MACs are
    counted (`choices.DISPATCH_FLOPS`, `choices.ATTENTION_MATMULS`); parameters are the same either way."""
    if input_size is not None:
        spec = at_input_size(spec, tuple(input_size))
    return _count(spec, Conventions(dispatch_flops, attention_matmuls))


@dataclass(frozen=True)
class Conventions:
    """How the MACs are counted: `count_macs`' keyword arguments."""

    dispatch_flops: str = "gather"
    attention_matmuls: str = "count"

    def __post_init__(self) -> None:
        for name, allowed in (("dispatch_flops", DISPATCH_FLOPS), ("attention_matmuls", ATTENTION_MATMULS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}")


def _count(spec: Spec, conventions: Conventions) -> SpecStats:
    """The counts of `spec`, from a dense backbone and a compiled model that live only as long as this call."""
    backbone = create_weightless_backbone(spec)
    plan = plan_for(spec, backbone)
    refuse_uncountable(spec, plan.input_size)
    dense_params = count_params(backbone)
    whole = [layer.path for layer in plan.layers if layer.whole_ffn]  # experts that are whole FFN copies
    dense = _macs(spec, backbone, plan.input_size, conventions, modules=whole)
    dense_macs = dense.total
    model = compile_model(backbone, plan, moe_device="meta").train()  # counted and costed, never run
    for path in whole:  # a copy on one image costs what the dense FFN's trace did at batch 1
        moe_layers(model)[path].ffn_macs = dense.modules[path]
    macs = _macs(spec, model, plan.input_size, conventions)  # MoE layers costed in training mode: the spec's
    _check_items(spec, plan, macs)
    dispatch = conventions.dispatch_flops
    layers = [_layer_stats(path, moe, plan.layer(path), macs, dispatch) for path, moe in moe_layers(model).items()]
    model.eval()  # the eval figures: the same items, eval_top_k and eval_capacity_factor where set
    layers = [_with_eval(layer, moe, plan.layer(layer.path), macs, dispatch) for layer, moe in
              zip(layers, moe_layers(model).values(), strict=True)]
    total = count_params(model)
    activated = total - sum(layer.params - layer.activated_params for layer in layers)
    differs = any(layer.eval_gmacs is not None for layer in layers)
    eval_activated = total - sum(layer.params - _eval(layer, "activated_params") for layer in layers)
    eval_gmacs = (macs.total - sum(macs.moe_layers.values())) / 1e9 + sum(_eval(layer, "gmacs") for layer in layers)
    return SpecStats(
        name=spec.name or spec.backbone.model,
        spec=spec.source or "",
        backbone=spec.backbone.model,
        input_size=plan.input_size,
        total_params=total,
        activated_params=activated,
        dense_params=dense_params,
        gmacs=macs.total / 1e9,
        dense_gmacs=dense_macs / 1e9,
        moe_layers=len(layers),
        experts_total=sum(layer.experts for layer in layers),
        layers=layers,
        eval_activated_params=eval_activated if differs else None,
        eval_gmacs=eval_gmacs if differs else None,
        dispatch_flops=conventions.dispatch_flops,
        attention_matmuls=conventions.attention_matmuls,
    )


def _eval(layer: LayerStats, name: str) -> float:
    """A layer's figure in eval mode: its `eval_` one where that differs, else the training one."""
    value = getattr(layer, f"eval_{name}")
    return getattr(layer, name) if value is None else value


def _with_eval(layer: LayerStats, moe: nn.Module, plan: LayerPlan, macs: MacCount, dispatch: str) -> LayerStats:
    """`layer` with its eval-mode figures (the module is in eval mode now), where they differ from training's:
    the router's `eval_top_k` or `eval_capacity_factor` uses other experts per item or another capacity."""
    activated, gmacs, executed = _figures(moe, macs.moe_items[layer.path], macs.moe_images[layer.path], dispatch)
    if (activated, gmacs, executed) == (layer.activated_params, layer.gmacs, layer.executed_gmacs):
        return layer
    return dataclasses.replace(layer, eval_top_k=plan.router.eval_picks(),
                               eval_activated_params=activated, eval_gmacs=gmacs, eval_executed_gmacs=executed)


def _layer_stats(path: str, moe: nn.Module, layer: LayerPlan, macs: MacCount, dispatch: str) -> LayerStats:
    """Params and MACs of one MoE layer (in the module's mode: training, then eval in `_with_eval`)."""
    items = macs.moe_items[path]
    activated, gmacs, executed = _figures(moe, items, macs.moe_images[path], dispatch)
    routed = count_params(moe.experts)
    return LayerStats(
        path=path, experts=moe.num_experts, top_k=layer.router.picks(), shared_experts=layer.shared_experts,
        params=count_params(moe), routed_params=routed, activated_params=activated, gmacs=gmacs,
        activated=layer.router.activated_unit(), items=items, executed_gmacs=executed,
        router=layer.router.describe(layer),
    )


def _figures(moe: nn.Module, items: int, images: int, dispatch: str) -> tuple[int, float, float | None]:
    """Activated params, activated GMACs and executed GMACs (None without a capacity) of one MoE layer for
    `items` items in `images` images. Activated params: the router, the shared experts and the routed experts
    one routed unit uses (`experts_per_item`: top_k per token or per image, E·C/T for expert choice, every
    expert for Soft MoE)."""
    routed = count_params(moe.experts)
    other = count_params(moe) - routed  # router (or Soft MoE's Phi and scale) + shared experts
    activated = other + round(moe.experts_per_item(items, images) * (routed // moe.num_experts))
    executed = moe.executed_macs(items, images)
    gmacs = layer_macs(moe, items, images, dispatch) / 1e9
    return activated, gmacs, executed / 1e9 if executed is not None else None


def _check_items(spec: Spec, plan: Plan, macs: MacCount) -> None:
    """Each router's checks against the items per image that the trace found: a located spec error, every
    layer's at once."""
    per_image = {path: items // max(macs.moe_images[path], 1) for path, items in macs.moe_items.items()}
    problems = items_problems(spec, plan.layers, per_image)
    if problems:
        raise SpecError(problems)


def _macs(spec: Spec, model: nn.Module, input_size: tuple[int, int, int], conventions: Conventions,
          modules: list[str] | None = None) -> MacCount:
    try:
        return count_macs(model, input_size, dispatch_flops=conventions.dispatch_flops,
                          attention_matmuls=conventions.attention_matmuls, modules=modules or ())
    except INPUT_SIZE_ERRORS as error:  # the input size's fault only where the plain forward refuses it too
        raise input_size_error(spec, input_size, error, step="counting MACs") from None

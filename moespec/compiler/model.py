"""The compiled model: the dense timm model itself, with MoE layers where the plan puts them.

    create_model(spec)          the MoE model of a spec, freshly initialized, in training mode (as timm's)
    compile_model(model, plan)  the plan applied to an already built dense model (shares its other modules)
    compile_graph(model, plan)  the torch.fx rewrite that `compile_model` installs: trace, check, swap
    plan_of(model)              the Plan a model of `create_model` (or `load`) was compiled from

The returned model is an instance of the backbone's own class (`VisionTransformer`, `ConvNeXt`, ...): every
timm method works (`forward_features`, `forward_intermediates`, `reset_classifier`, `group_matcher`,
`set_grad_checkpointing`) and `model.blocks[i]` indexes as in timm. Each MoE layer carries its `LayerPlan`
(`layer.plan`). `no_weight_decay()` adds the experts' stacks of 1-D parameters (biases, norms) to the dense
model's list, so that timm's optimizer factory treats them as it treats the dense FFN's (`NoWeightDecay`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.nn.parallel import DistributedDataParallel

from ..backbones import create_backbone, refuse_if_too_large, resolve_device
from ..errors import MoespecError, SpecError
from ..layers import BalancingBias, Experts, MoELayer, set_expert_step
from ..layers.steps import check_step
from ..planning import Plan, plan_for
from ..spec import HUB_ARCHITECTURE, HUB_SPEC_ARG, Spec, located, spec_metadata
from .passes import copy_along, replace_ffns, replace_untraced, rescale_blocks
from .tracer import TraceFailure, release, trace


def compile_graph(model: nn.Module, plan: Plan, *, moe_device: str | torch.device | None = None) -> fx.GraphModule:
    """The traced `model` with the plan's passes applied. It shares every module it did not replace with
    `model`, which it leaves as it was."""
    return _rewrite(model, plan, moe_device)[0]


def compile_model(model: nn.Module, plan: Plan, *, moe_device: str | torch.device | None = None,
                  inplace: bool = False) -> nn.Module:
    """`model` (a copy of it sharing its other modules, unless `inplace`) with the modules that
    `compile_graph` swapped at their call sites swapped in: the same class, the same function as the
    rewritten graph. Its MoE layers are built on `moe_device` (default: the backbone's device). A model that
    torch.fx cannot trace (Twins) gets its FFNs swapped by path where their forward takes one tensor
    (`replace_untraced`)."""
    try:
        gm, swapped = _rewrite(model, plan, moe_device)
        release(gm)  # only its modules are kept
    except TraceFailure:
        if plan.rescales:
            raise
        swapped = replace_untraced(model, plan, moe_device)
    out = model if inplace else copy_along(model, list(swapped))
    for path, module in swapped.items():
        out.set_submodule(path, module)
    dense = getattr(type(model), "no_weight_decay", None)  # the class's: `inplace` may compile a compiled model
    out.no_weight_decay = NoWeightDecay(frozenset(dense(out) if dense is not None else ()) | _stacked_1d(out))
    _keep_counts_per_rank(out)
    return out


def _keep_counts_per_rank(model: nn.Module) -> None:
    """DistributedDataParallel broadcasts rank 0's buffers at a forward that follows a synchronized one, which
    would overwrite the balancing biases' counts (`tokens_per_expert`: this rank's choices since the last
    `update_bias`, summed over the ranks there) within a gradient accumulation. DDP leaves alone the names
    that the module it wraps lists for it: this model's counts."""
    counts = [f"{path}.tokens_per_expert" for path, module in model.named_modules()
              if isinstance(module, BalancingBias)]
    if counts:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, counts)


def _rewrite(model: nn.Module, plan: Plan, moe_device) -> tuple[fx.GraphModule, dict[str, nn.Module]]:
    """The rewritten graph, and the new module of each swapped path (rebuilt blocks first).

    With rescaled blocks: trace with those blocks as leaves, rebuild them (`rescale_blocks`), then trace
    again through the rebuilt blocks so that their FFN call sites can be replaced like any other.
    """
    ffns = {layer.path for layer in plan.layers}
    traced, swapped = model, {}
    if plan.rescales:
        blocks = {r.block for r in plan.rescales}
        traced = rescale_blocks(trace(model, blocks | {p for p in ffns if plan.rebuilt(p) is None}), plan)
        swapped.update((block, traced.get_submodule(block)) for block in sorted(blocks))
    gm = replace_ffns(trace(traced, ffns), plan, moe_device)
    if traced is not model:
        release(traced)  # the step between: its modules live on in `gm`
    swapped.update((layer.path, gm.get_submodule(layer.path)) for layer in plan.layers)
    return gm, swapped


def plan_of(model: nn.Module) -> Plan:
    """The Plan that `model`, built by `create_model` (or `load`, `upcycle`, a registered timm name), was
    compiled from: the plan of the spec it carries (`model.moespec_spec`) on the backbone built on the meta
    device, the same plan as the model's build, since a plan is a function of the spec. Each MoE layer also
    carries its own part (`layer.plan`)."""
    spec = getattr(model, "moespec_spec", None)
    if spec is None:
        raise MoespecError("this model was not built by moespec (no spec attached); build it with "
                           "moespec.create_model, or keep the plan you passed to compile_model")
    return plan_for(spec, create_backbone(spec, device="meta"))


def create_model(spec: Spec, *, device: str | torch.device = "cpu", seed: int | None = None,
                 moe_device: str | torch.device | None = None, expert_step: str = "auto") -> nn.Module:
    """The MoE model of `spec`, randomly initialized (timm's init for the backbone), in training mode like a
    fresh timm model, with every parameter and buffer on `device` ("cpu", "cuda", "cuda:N", "meta", ...).

    `seed` makes the initialization reproducible without touching the caller's random state (the same weights
    as `torch.manual_seed(seed)` before the call). `device="meta"` builds it without allocating weights (for
    counting parameters); `moe_device="meta"` builds only the MoE layers so (to be filled from a file).

    Before allocating anything, the model is built on the meta device and counted: one whose parameters and
    buffers would not fit in the device's memory is refused (`check_fits_in_memory`).

    `expert_step` forces every MoE layer's expert step (`layers.steps`: loop, padded, grouped_mm, triton);
    "auto" lets the rule pick per call. `moespec.set_expert_step(model, name)` changes it later.
    """
    check_step(expert_step)
    device = resolve_device(device)
    moe_device = resolve_device(moe_device) if moe_device is not None else None
    if device.type != "meta" and moe_device is None:
        plan = check_fits_in_memory(spec, device)
    seeded = contextlib.nullcontext()
    if seed is not None:
        seeded = torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else [])
    with seeded:
        if seed is not None:
            torch.manual_seed(seed)
        backbone = create_backbone(spec, device=device, check_memory=moe_device is not None)
        if device.type == "meta" or moe_device is not None:
            plan = plan_for(spec, backbone)
        model = compile_model(backbone, plan, moe_device=moe_device, inplace=True)
    model.moespec_spec = spec
    carry_spec(model, spec)
    return set_expert_step(model, expert_step).train()


def carry_spec(model: nn.Module, spec: Spec) -> None:
    """Make timm's own export (`timm.models.save_for_hf`, `push_to_hf_hub`) write a folder that builds this MoE
    model: its pretrained_cfg (the dense backbone's mean, std, input size, crop) names moespec's architecture,
    and the reconstruction arguments timm records (`_model_args`, the backbone's kwargs) carry the spec
    (`spec.embedded`). Where moespec is not imported, timm refuses that architecture instead of building the
    dense backbone. A spec that has no YAML form is not carried: timm's load of such a folder says so."""
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, dict):
        cfg["architecture"] = HUB_ARCHITECTURE  # in place: timm's `default_cfg` is the same dict
        cfg.pop("tag", None)  # the dense weights' tag: not this model's
    try:
        carried = spec_metadata(spec)
    except ValueError:  # a spec built in Python with objects in its kwargs (a functools.partial) has no YAML
        return
    model._model_args = {**getattr(model, "_model_args", {}), HUB_SPEC_ARG: carried}


@dataclass(frozen=True)
class NoWeightDecay:
    """A compiled model's `no_weight_decay()`: the dense class's names plus the experts' stacked biases and
    norm parameters, which timm's rule (1-D, or a name ending in ".bias") misses in their [E, n] stacks.

    timm's optimizer factory asks the model itself, and the model stays an instance of the timm class, so this
    is set on the instance; it is plain data (a set of names fixed at compile time, which `shard_experts` and
    loading keep), not a method bound to the model: the model holds no reference to itself, so it is freed
    as soon as it is dropped, and it copies and pickles as any timm model."""

    names: frozenset[str]

    def __call__(self) -> set[str]:
        return set(self.names)


def _stacked_1d(model: nn.Module) -> frozenset[str]:
    """The expert banks' [E, n] parameters: stacks of the dense FFN's 1-D biases and norm parameters."""
    return frozenset(f"{path}.{bank_name}.{name}" for path, layer in moe_layers(model).items()
                     for bank_name, bank in layer.named_modules() if isinstance(bank, Experts)
                     for name, param in bank.named_parameters() if param.dim() == 2)


def check_fits_in_memory(spec: Spec, device: str | torch.device = "cpu") -> Plan:
    """Refuse to build the model of `spec` on `device` when its parameters and buffers (the dense backbone,
    experts, routers and gates, Soft MoE slots, shared experts, rebuilt blocks) need more than a share of the
    device's memory: a clear error instead of the out-of-memory killer. Counted on a build on the meta device,
    where nothing is allocated. Returns the plan (the same for a build on any device)."""
    backbone = create_backbone(spec, device="meta")
    plan = plan_for(spec, backbone)
    model = compile_model(backbone, plan, moe_device="meta", inplace=True)
    try:
        refuse_if_too_large(model, resolve_device(device), "the model")
    except SpecError as error:
        raise located(spec, error) from None
    return plan


def moe_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The MoE layers of a compiled model, by qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}

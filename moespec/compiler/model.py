"""The compiled model: trace the dense timm model, apply the plan's passes, attach the spec and the plan.

    create_model(spec)          the MoE model of a spec, freshly initialized
    compile_model(model, plan)  the passes on an already built dense model (shares its other modules)
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import fx, nn

from ..backbones import create_backbone
from ..errors import MoespecError
from ..layers import MOE_LAYERS
from ..planning import Plan, plan_for
from ..spec import Spec
from .passes import replace_ffns, rescale_blocks
from .tracer import trace


def compile_model(model: nn.Module, plan: Plan, *, moe_device: str | torch.device | None = None) -> fx.GraphModule:
    """Trace `model` and apply the plan. The result shares the non-FFN modules of `model`; its MoE layers
    are built on `moe_device` (default: the backbone's device).

    With rescaled blocks: trace with those blocks as leaves, rebuild them (`rescale_blocks`), then trace
    again through the rebuilt blocks so that their FFN call sites can be replaced like any other.
    """
    ffns = {layer.path for layer in plan.layers}
    gm = model
    if plan.rescales:
        blocks = {r.block for r in plan.rescales}
        gm = rescale_blocks(trace(model, blocks | {p for p in ffns if plan.rebuilt(p) is None}), plan)
    gm = replace_ffns(trace(gm, ffns), plan, moe_device)
    gm.moespec_plan = plan
    return gm.train(model.training)


def create_model(spec: Spec, *, device: str | torch.device = "cpu", seed: int | None = None) -> fx.GraphModule:
    """The MoE model of `spec`, randomly initialized (timm's init for the backbone). Eval mode.

    `seed` makes the initialization reproducible without touching the caller's random state (the same weights
    as `torch.manual_seed(seed)` before the call). `device="meta"` builds it without allocating weights (for
    counting parameters).
    """
    seeded = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with seeded:
        if seed is not None:
            torch.manual_seed(seed)
        backbone = create_backbone(spec, device=device)
        plan = plan_for(spec, backbone)
        if str(device) != "meta":
            check_fits_in_memory(backbone, plan)
        model = compile_model(backbone, plan)
    model.moespec_spec = spec
    return model


def check_fits_in_memory(backbone: nn.Module, plan: Plan, share: float = 0.8) -> None:
    """Refuse to build experts whose weights need more than `share` of this machine's memory (a clear error
    instead of the out-of-memory killer). `validate`, `plan` and `stats` never build experts."""
    modules = dict(backbone.named_modules())
    expert_bytes = 0
    for layer in plan.layers:
        ffn = modules[layer.path]
        per_unit = sum(p.numel() * p.element_size() for p in ffn.parameters()) / layer.dense_hidden
        expert_bytes += (layer.experts + layer.shared_experts) * layer.expert_hidden * per_unit
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if expert_bytes > share * memory:
        raise MoespecError(
            f"{plan.name}: its experts need about {expert_bytes / 2**30:.0f} GiB of weights, more than this "
            f"machine's {memory / 2**30:.0f} GiB allow; too large to instantiate here. validate, plan and stats "
            f"work without building the experts")


def moe_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The MoE layers of a compiled model, by qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MOE_LAYERS)}

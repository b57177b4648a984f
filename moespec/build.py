"""The one builder that turns a `LayerPlan` (numbers plus the spec's router and aux-loss choices) into an
MoE module. Modules never see a spec; this is the only place that translates."""

from __future__ import annotations

import torch
from torch import nn

from .adapters import adapter_named
from .layers import ROUTERS, LinearGate, MoE, ProjectedGate, SoftMoE
from .plan import LayerPlan

DEFAULT_GATE_DIM, DEFAULT_TEMPERATURE = 16, 0.07  # cosine / l2 gates (X-MoE, Chi et al. 2022)


def build_moe(layer: LayerPlan, dense_ffn: nn.Module) -> nn.Module:
    """An MoE layer with the structure of `dense_ffn` at the plan's widths, freshly initialized."""
    adapter = adapter_named(layer.family)
    experts = adapter.build_experts(dense_ffn, layer.experts, layer.expert_hidden)
    shared = adapter.build_experts(dense_ffn, layer.shared_experts, layer.expert_hidden) if layer.shared_experts else None
    spec = layer.router
    if spec.kind == "soft":
        return SoftMoE(experts, spec.slots_per_expert, shared, channels_dim=layer.channels_dim)
    gate = build_gate(spec.gate, layer.in_features, layer.experts)
    if spec.kind == "topk":
        noise = (1.0 / layer.experts if spec.noise is True else float(spec.noise))
        router = ROUTERS["topk"](gate, layer.experts, layer.top_k, normalize=spec.normalize, noise_std=noise,
                                 capacity_factor=layer.capacity_factor, bpr=spec.bpr, drop_fraction=spec.drop_fraction)
    elif spec.kind == "image":
        router = ROUTERS["image"](gate, layer.experts, layer.top_k, normalize=spec.normalize, pool=layer.pool)
    else:
        router = ROUTERS[spec.kind](gate, layer.experts, capacity=spec.capacity)
    weights: dict[str, float] = {}
    for aux in layer.aux_losses:
        weights[aux.kind] = weights.get(aux.kind, 0.0) + aux.weight
    return MoE(router, experts, shared, channels_dim=layer.channels_dim, aux_loss_weights=weights,
               aux_loss_in_backward=layer.aux_loss_in_backward)


def build_gate(gate, dim: int, experts: int) -> nn.Module:
    """The gate module of a spec's `gate:` (linear, cosine or l2)."""
    if gate.kind == "linear":
        return LinearGate(dim, experts)
    return ProjectedGate(dim, experts, proj_dim=gate.dim or DEFAULT_GATE_DIM,
                         temperature=gate.temperature or DEFAULT_TEMPERATURE, metric=gate.kind)


def materialize(module: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """Give a module built on the meta device real storage on `device` and its fresh initialization: every
    submodule's `reset_parameters`, children before parents (a parent may re-initialize its children)."""
    module.to_empty(device=device)
    with torch.no_grad():
        for m in reversed(list(module.modules())):
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    return module

"""The one builder that turns a `LayerPlan` (numbers plus the spec's router and aux-loss choices) into an
`MoE` module. Modules never see a spec; this is the only place that translates."""

from __future__ import annotations

from torch import nn

from .adapters import find_adapter
from .layers import ROUTERS, MoE
from .plan import LayerPlan


def build_moe(layer: LayerPlan, dense_ffn: nn.Module) -> MoE:
    """An MoE layer with the structure of `dense_ffn` at the plan's widths, freshly initialized."""
    adapter = find_adapter(dense_ffn)
    router_cls = ROUTERS[layer.router.kind]
    router = router_cls(layer.in_features, layer.experts, layer.top_k, normalize=layer.router.normalize)
    experts = adapter.build_experts(dense_ffn, layer.experts, layer.expert_hidden)
    shared = adapter.build_experts(dense_ffn, layer.shared_experts, layer.expert_hidden) if layer.shared_experts else None
    weights: dict[str, float] = {}
    for aux in layer.aux_losses:
        weights[aux.kind] = weights.get(aux.kind, 0.0) + aux.weight
    return MoE(router, experts, shared, channels_dim=layer.channels_dim, capacity_factor=layer.capacity_factor,
               aux_loss_weights=weights)

"""The one builder that turns a `LayerPlan` into an MoE module: the FFN family's adapter builds the expert
banks, the router kind builds the rest. Modules never see a spec."""

from __future__ import annotations

import torch
from torch import nn

from ..backbones import adapter_named
from ..planning import LayerPlan


def build_moe(layer: LayerPlan, dense_ffn: nn.Module) -> nn.Module:
    """An MoE layer with the structure of `dense_ffn` at the plan's widths, freshly initialized. It carries
    `layer` as `plan` (plain data, read by later stages: `inspect`, `plan_of`), which its forward never reads."""
    adapter = adapter_named(layer.family)
    experts = adapter.build_experts(dense_ffn, layer.num_experts, layer.expert_hidden)
    shared = None
    if layer.shared_experts:
        shared = adapter.build_experts(dense_ffn, layer.shared_experts, layer.expert_hidden)
    moe = layer.router.build(layer, experts, shared)
    moe.pre = adapter.pre_module(dense_ffn)
    moe.plan = layer
    return moe


def materialize(module: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """Give a module built on the meta device real storage on `device` and its fresh initialization: every
    submodule's `reset_parameters`, children before parents (a parent may re-initialize its children)."""
    module.to_empty(device=device)
    with torch.no_grad():
        for m in reversed(list(module.modules())):
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    return module

"""The one builder that turns a `LayerPlan` into an MoE module: the FFN family's adapter builds the expert
banks, the router kind builds the rest. Modules never see a spec."""

from __future__ import annotations

import torch
from torch import nn

from ..backbones import adapter_named
from ..layers import FFNCopies
from ..planning import LayerPlan


def build_moe(layer: LayerPlan, dense_ffn: nn.Module) -> nn.Module:
    """An MoE layer with the structure of `dense_ffn` at the plan's widths, freshly initialized. It carries
    `layer` as `plan` (plain data, read by later stages: `inspect`, `plan_of`), which its forward never reads."""
    adapter = adapter_named(layer.family)
    if layer.whole_ffn:  # an FFN that mixes positions: whole copies, routed per image
        experts = _fresh(FFNCopies(dense_ffn, layer.num_experts))
        shared = _fresh(FFNCopies(dense_ffn, layer.shared_experts)) if layer.shared_experts else None
        moe = layer.router.build(layer, experts, shared)
        moe.plan = layer
        return moe
    experts = adapter.build_experts(dense_ffn, layer.num_experts, layer.expert_hidden)
    shared = None
    if layer.shared_experts:
        shared = adapter.build_experts(dense_ffn, layer.shared_experts, layer.expert_hidden)
    moe = layer.router.build(layer, experts, shared)
    moe.pre = adapter.pre_module(dense_ffn)
    moe.plan = layer
    return moe


def _fresh(copies: nn.Module) -> nn.Module:
    """Copies of the dense FFN (made on the current default device) with their own fresh initialization: every
    submodule's `reset_parameters`, as `materialize` gives a bank built on the meta device."""
    copies = copies.to(torch.empty(0).device)
    if copies.copies and next(copies.parameters()).device.type != "meta":
        with torch.no_grad():
            for m in reversed(list(copies.modules())):
                if hasattr(m, "reset_parameters") and m is not copies:
                    m.reset_parameters()
    return copies


def materialize(module: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """Give a module built on the meta device real storage on `device` and its fresh initialization: every
    submodule's `reset_parameters`, children before parents (a parent may re-initialize its children)."""
    module.to_empty(device=device)
    with torch.no_grad():
        for m in reversed(list(module.modules())):
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    return module

"""Graph passes: small functions `GraphModule -> GraphModule` that apply a plan, lint and recompile, and name
themselves in their errors.

    replace_ffns(gm, plan)    each planned FFN call node now calls an MoE layer that keeps the FFN's
                              qualified name (so `blocks.1.mlp.experts.fc1.weight`)
    rescale_blocks(gm, plan)  each planned block rebuilt at [S1, C1], between two rescale layers (Sparse-MLP)
"""

from __future__ import annotations

import torch
from torch import fx

from ..backbones import find_rebuilder
from ..layers import Rescale
from ..planning import Plan
from .build import build_moe
from .tracer import CompileError


def replace_ffns(gm: fx.GraphModule, plan: Plan, moe_device: str | torch.device | None = None) -> fx.GraphModule:
    """Graph pass: swap the call node of every planned FFN for a call to a freshly built MoE layer, on
    `moe_device` (default: the FFN's device; "meta" for counting without allocating experts)."""
    for layer in plan.layers:
        calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == layer.path]
        if not calls:
            raise CompileError(f"replace_ffns: {layer.path} is never called in the traced forward of {plan.model}")
        dense = gm.get_submodule(layer.path)
        with torch.device(moe_device or next(dense.parameters()).device):
            moe = build_moe(layer, dense)
        gm.delete_submodule(layer.path)
        gm.add_submodule(layer.path, moe)
        for call in calls:
            with gm.graph.inserting_after(call):
                moe_call = gm.graph.call_module(layer.path, call.args, call.kwargs)
            call.replace_all_uses_with(moe_call)
            gm.graph.erase_node(call)
    gm.graph.lint()
    gm.recompile()
    return gm


def rescale_blocks(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Graph pass (Sparse-MLP): rebuild each planned block at [S1, C1] and wrap its call node as
    `block.rescale_in` (pro-token, [S, C] -> [S1, C1]) -> block -> `block.rescale_out` (pro-channel, back).
    The rescale layers live under the block's name, so all of a rebuilt block's weights share its prefix."""
    for rescale in plan.rescales:
        calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == rescale.block]
        if not calls:
            raise CompileError(f"rescale_blocks: {rescale.block} is never called in the traced forward")
        old = gm.get_submodule(rescale.block)
        with torch.device(next(old.parameters()).device):
            new = find_rebuilder(old).rebuild(old, rescale.rescaled_tokens, rescale.rescaled_channels,
                                              rescale.token_hidden, rescale.channel_hidden)
            shape, rescaled = (rescale.tokens, rescale.channels), (rescale.rescaled_tokens, rescale.rescaled_channels)
            new.rescale_in, new.rescale_out = Rescale(*shape, *rescaled), Rescale(*rescaled, *shape)
        gm.delete_submodule(rescale.block)
        gm.add_submodule(rescale.block, new)
        for call in calls:
            with gm.graph.inserting_before(call):
                inner = gm.graph.call_module(f"{rescale.block}.rescale_in", call.args[:1])
                block = gm.graph.call_module(rescale.block, (inner, *call.args[1:]), call.kwargs)
                outer = gm.graph.call_module(f"{rescale.block}.rescale_out", (block,))
            call.replace_all_uses_with(outer)
            gm.graph.erase_node(call)
    gm.graph.lint()
    gm.recompile()
    return gm



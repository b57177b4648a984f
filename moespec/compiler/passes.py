"""Graph passes: small functions `GraphModule -> GraphModule` that apply a plan to a traced model. Each checks
with the graph that its rewrite is a module swap that keeps the dataflow (the module is called, with one
tensor in and the result out), swaps the module, lints and recompiles, and names itself in its errors.

    replace_ffns(gm, plan)    each planned FFN is now an MoE layer under the FFN's qualified name (so
                              `blocks.1.mlp.experts.fc1.weight`)
    rescale_blocks(gm, plan)  each planned block rebuilt at [S1, C1] between two rescale layers (Sparse-MLP),
                              under the block's name

Because every rewrite is a swap of the module at a call site, the timm model with the same modules swapped
computes what the rewritten graph computes (`model.compile_model` returns that model).
"""

from __future__ import annotations

import torch
from torch import fx

from ..backbones import find_rebuilder
from ..layers import rescaled
from ..planning import Plan
from .build import build_moe
from .tracer import CompileError


def replace_ffns(gm: fx.GraphModule, plan: Plan, moe_device: str | torch.device | None = None) -> fx.GraphModule:
    """Graph pass: swap every planned FFN for a freshly built MoE layer, on `moe_device` (default: the FFN's
    device; "meta" for counting without allocating experts)."""
    for layer in plan.layers:
        check_call_sites(gm, layer.path, "replace_ffns", plan.model)
        dense = gm.get_submodule(layer.path)
        with torch.device(moe_device or next(dense.parameters()).device):
            moe = build_moe(layer, dense)
        _swap(gm, layer.path, moe)
    gm.graph.lint()
    gm.recompile()
    return gm


def rescale_blocks(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Graph pass (Sparse-MLP): rebuild each planned block at [S1, C1], wrapped as `rescale_in` (pro-token,
    [S, C] -> [S1, C1]) -> block -> `rescale_out` (pro-channel, back) by `layers.rescaled`. The rescale layers
    live under the block's name, so all of a rebuilt block's weights share its prefix."""
    for rescale in plan.rescales:
        check_call_sites(gm, rescale.block, "rescale_blocks", plan.model)
        old = gm.get_submodule(rescale.block)
        with torch.device(next(old.parameters()).device):
            new = find_rebuilder(old).rebuild(old, rescale.rescaled_tokens, rescale.rescaled_channels,
                                              rescale.token_hidden, rescale.channel_hidden)
            new = rescaled(new, (rescale.tokens, rescale.channels),
                           (rescale.rescaled_tokens, rescale.rescaled_channels))
        _swap(gm, rescale.block, new)
    gm.graph.lint()
    gm.recompile()
    return gm


def check_call_sites(gm: fx.GraphModule, path: str, rewrite: str, model: str) -> None:
    """The module at `path` is called in the traced forward, each time as `module(x)`: one positional
    argument, no keyword, so that a module of the same signature can take its place."""
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == path]
    if not calls:
        raise CompileError(f"{rewrite}: {path} is never called in the traced forward of {model}")
    for call in calls:
        if len(call.args) != 1 or call.kwargs or not isinstance(call.args[0], fx.Node):
            raise CompileError(f"{rewrite}: {model} calls {path} as {call.format_node()}; moespec replaces only "
                               f"modules called on one tensor, module(x)")


def _swap(gm: fx.GraphModule, path: str, module: torch.nn.Module) -> None:
    gm.delete_submodule(path)
    gm.add_submodule(path, module)

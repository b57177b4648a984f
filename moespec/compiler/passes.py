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

import copy
import inspect

import torch
from torch import fx, nn

from ..backbones import find_rebuilder
from ..layers import rescaled
from ..planning import Plan
from .build import build_moe
from .tracer import CompileError


def replace_ffns(gm: fx.GraphModule, plan: Plan, moe_device: str | torch.device | None = None) -> fx.GraphModule:
    """Graph pass: swap every planned FFN for a freshly built MoE layer, on `moe_device` (default: the FFN's
    device; "meta" for counting without allocating experts)."""
    for layer in plan.layers:
        leaf = check_call_sites(gm, layer.path, "replace_ffns", plan.model, more_args=layer.whole_ffn)
        if leaf is not None:  # swap in a copy of the leaf, which `gm` shares with the model it traced
            gm.set_submodule(leaf, copy_along(gm.get_submodule(leaf), [layer.path[len(leaf) + 1:]]))
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
        if check_call_sites(gm, rescale.block, "rescale_blocks", plan.model) is not None:
            raise CompileError(f"rescale_blocks: {rescale.block} is inside a module torch.fx does not trace; "
                               f"moespec rebuilds only blocks the traced forward calls")
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


def check_call_sites(gm: fx.GraphModule, path: str, rewrite: str, model: str, *, more_args: bool = False
                     ) -> str | None:
    """The module at `path` is called in the traced forward, each time as `module(x)`: one positional
    argument, no keyword, so that a module of the same signature can take its place. With `more_args` (an MoE
    layer of whole FFN copies, which passes them on: PVT-v2's `mlp(x, feat_size)`), more positional arguments
    may follow the tensor.

    Inside a module that the graph calls as a leaf (timm's notrace modules, such as TinyViT's blocks, whose
    forward fx cannot trace) the calls are out of sight: there the module's forward must take one argument,
    so that every call is `module(x)`. Returns that leaf's path, or None."""
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == path]
    if not calls:
        leaf = next((n.target for n in gm.graph.nodes if n.op == "call_module" and path.startswith(n.target + ".")),
                    None)
        if leaf is None:
            raise CompileError(f"{rewrite}: {path} is never called in the traced forward of {model}")
        if not more_args:
            check_one_argument(gm.get_submodule(path), path, f"{rewrite}: {model} calls {path} inside {leaf}, "
                                                             f"which torch.fx does not trace")
        return leaf
    for call in calls:
        if (len(call.args) != 1 and not more_args) or call.kwargs or not isinstance(call.args[0], fx.Node):
            raise CompileError(f"{rewrite}: {model} calls {path} as {call.format_node()}; moespec replaces only "
                               f"modules called on one tensor, module(x)")


def check_one_argument(module: nn.Module, path: str, where: str) -> None:
    """Where no graph shows the calls of `module`: its forward takes one argument, so that every call is
    `module(x)` and an MoE layer can take its place."""
    parameters = list(inspect.signature(module.forward).parameters.values())
    if len(parameters) != 1 or parameters[0].kind not in (parameters[0].POSITIONAL_ONLY,
                                                          parameters[0].POSITIONAL_OR_KEYWORD):
        raise CompileError(f"{where}, and the forward of {path} takes ({', '.join(map(str, parameters))}); there "
                           f"moespec replaces only modules whose forward takes one tensor")


def replace_untraced(model: nn.Module, plan: Plan, moe_device: str | torch.device | None = None
                     ) -> dict[str, nn.Module]:
    """For a model torch.fx cannot trace: the MoE layer of each planned FFN, each FFN's forward checked to take
    one tensor (`check_one_argument`), to swap in by path. No graph: `compile_graph` has none to give."""
    swapped = {}
    for layer in plan.layers:
        dense = model.get_submodule(layer.path)
        if not layer.whole_ffn:  # whole FFN copies take the FFN's own arguments
            check_one_argument(dense, layer.path, f"replace_ffns: torch.fx could not trace {plan.model}")
        with torch.device(moe_device or next(dense.parameters()).device):
            swapped[layer.path] = build_moe(layer, dense)
    return swapped


def copy_along(model: nn.Module, paths: list[str]) -> nn.Module:
    """A shallow copy of `model` and of every module on the way to `paths`, so that swapping the modules at
    `paths` in the copy leaves `model` as it was; every other module (and every tensor) is shared."""
    root, copied = _shallow(model), set()
    for path in paths:
        parent, names = root, path.split(".")[:-1]
        for depth, name in enumerate(names):
            prefix = ".".join(names[: depth + 1])
            if prefix not in copied:
                parent._modules[name] = _shallow(parent._modules[name])
                copied.add(prefix)
            parent = parent._modules[name]
    return root


def _shallow(module: nn.Module) -> nn.Module:
    twin = copy.copy(module)
    twin._modules = dict(module._modules)  # its own children table; the children themselves are shared
    return twin


def _swap(gm: fx.GraphModule, path: str, module: torch.nn.Module) -> None:
    gm.delete_submodule(path)
    gm.add_submodule(path, module)

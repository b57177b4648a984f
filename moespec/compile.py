"""The compiler: trace the timm model with torch.fx, then rewrite FFN call sites into MoE layers.

    trace(model, leaves)      -> GraphModule; only the ancestors of the FFNs to replace are traced through
    replace_ffns(gm, plan)    -> GraphModule; each planned FFN call node now calls an MoE layer that keeps
                                 the FFN's qualified name (so `blocks.1.mlp.experts.fc1.weight`)

Tracing only through the FFNs' ancestors keeps every other module a leaf that runs its own eager forward,
so `train()` / `eval()` behaviour (dropout, drop-path, attention dropout) is never frozen into the graph.
timm's notrace modules and functions are leaves too, and the MoE layer is a leaf: routing is never traced.
"""

from __future__ import annotations

import os

import torch
from timm.layers import get_notrace_functions, get_notrace_modules
from torch import fx, nn

from .backbone import create_backbone
from .blocks import find_rebuilder
from .build import build_moe
from .errors import MoespecError
from .layers import MOE_LAYERS
from .layers.rescale import Rescale
from .plan import Plan, plan_for
from .spec import Spec

# Attributes of timm models that training scripts and data configs read; copied onto the GraphModule.
TIMM_ATTRIBUTES = ("pretrained_cfg", "default_cfg", "num_classes", "num_features", "head_hidden_size",
                   "embed_dim", "num_prefix_tokens", "global_pool", "feature_info")


class CompileError(MoespecError):
    """A graph pass could not apply the plan to the traced model."""


class MoETracer(fx.Tracer):
    """Traces through the ancestors of `targets`; every other module (and each target) is a leaf."""

    def __init__(self, targets: set[str]):
        super().__init__(autowrap_functions=tuple(f for f in get_notrace_functions() if callable(f)))
        self.targets = targets
        self.ancestors = {".".join(t.split(".")[:i]) for t in targets for i in range(1, len(t.split(".")))}
        self.notrace = tuple(get_notrace_modules())

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        if qualified_name in self.targets or isinstance(module, self.notrace):
            return True
        return qualified_name not in self.ancestors


def trace(model: nn.Module, targets: set[str]) -> fx.GraphModule:
    """Symbolically trace `model` with the FFNs at `targets` as leaf call sites."""
    tracer = MoETracer(targets)
    try:
        graph = tracer.trace(model)
    except Exception as err:  # fx raises plain TraceError / TypeError with little context
        raise CompileError(f"torch.fx could not trace {type(model).__name__}: {err}") from err
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    for name in TIMM_ATTRIBUTES:
        if hasattr(model, name):
            setattr(gm, name, getattr(model, name))
    return gm


def replace_ffns(gm: fx.GraphModule, plan: Plan, moe_device: str | torch.device | None = None) -> fx.GraphModule:
    """Graph pass: swap the call node of every planned FFN for a call to a freshly built MoE layer, on
    `moe_device` (default: the FFN's device; "meta" for counting without allocating experts)."""
    for layer in plan.layers:
        calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == layer.path]
        if not calls:
            raise CompileError(f"replace_ffns: {layer.path} is never called in the traced forward of {plan.spec.backbone.model}")
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
            new.rescale_in = Rescale(rescale.tokens, rescale.channels, rescale.rescaled_tokens, rescale.rescaled_channels)
            new.rescale_out = Rescale(rescale.rescaled_tokens, rescale.rescaled_channels, rescale.tokens, rescale.channels)
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
    gm.moespec_spec = plan.spec
    gm.moespec_plan = plan
    return gm.train(model.training)


def create_model(spec: Spec, *, device: str | torch.device = "cpu") -> fx.GraphModule:
    """The MoE model of `spec`, randomly initialized (timm's init for the backbone). Eval mode.

    `device="meta"` builds it without allocating weights (for counting parameters).
    """
    backbone = create_backbone(spec, device=device)
    plan = plan_for(spec, backbone)
    if str(device) != "meta":
        check_fits_in_memory(backbone, plan)
    return compile_model(backbone, plan)


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
            f"{plan.spec.name}: its experts need about {expert_bytes / 2**30:.0f} GiB of weights, more than this "
            f"machine's {memory / 2**30:.0f} GiB allow; too large to instantiate here. validate, plan and stats "
            f"work without building the experts")


def moe_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The MoE layers of a compiled model, by qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MOE_LAYERS)}

"""Tracing a timm model with torch.fx, through the ancestors of the call sites to replace only.

Tracing only through the FFNs' ancestors keeps every other module a leaf that runs its own eager forward,
so `train()` / `eval()` behaviour (dropout, drop-path, attention dropout) is never frozen into the graph.
timm's notrace modules and functions are leaves too, and the MoE layer is a leaf: routing is never traced.
The MoE layers are timm notrace modules (registered here), so timm's FX feature extraction keeps them as leaves;
any other fx tracer gets them as one node from their forward (`layers.ops.mode.layer_call`).
"""

from __future__ import annotations

from timm.layers import get_notrace_functions, get_notrace_modules, register_notrace_module
from torch import fx, nn

from ..errors import MoespecError
from ..layers import MoELayer

register_notrace_module(MoELayer)

# Attributes of timm models that training scripts and data configs read; copied onto the GraphModule.
TIMM_ATTRIBUTES = ("pretrained_cfg", "default_cfg", "num_classes", "num_features", "head_hidden_size",
                   "embed_dim", "num_prefix_tokens", "global_pool", "feature_info")


class CompileError(MoespecError):
    """A graph pass could not apply the plan to the traced model."""


class TraceFailure(CompileError):
    """torch.fx could not trace the model's forward (Python control flow on tensors, a tuple returned by a
    leaf and unpacked)."""


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
        raise TraceFailure(f"torch.fx could not trace {type(model).__name__}: {err}") from err
    finally:
        # The tracer sits in reference cycles (its proxies and the closures it patched in point back at it),
        # which only the cycle collector frees. Emptied, they hold nothing of the model, which is freed as
        # soon as it is dropped.
        vars(tracer).clear()
    gm = fx.GraphModule(model, graph, type(model).__name__)  # the tracer's root is `model`
    for name in TIMM_ATTRIBUTES:
        if hasattr(model, name):
            setattr(gm, name, getattr(model, name))
    return gm


def release(gm: fx.GraphModule) -> None:
    """Done with `gm`: break the reference cycle between it and its graph (`graph.owning_module`), so that
    it and the modules it holds are freed as soon as it is dropped, not when the cycle collector gets round to
    it. `gm` is not to be used afterwards."""
    gm.graph.owning_module = None

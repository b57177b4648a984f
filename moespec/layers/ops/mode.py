"""How one MoE layer call runs, decided once at the top of its forward and carried down: the one file that asks
torch whether it is compiling, exporting, tracing (torch.fx, TorchScript) or under autocast.

`Mode.of(x, bank)` at the top of `MoE.forward`, `SoftMoE.forward` and `Experts.forward` reads every question once;
the record travels down with the routed rows (`steps.rows.RoutedRows.mode`) to the step chooser and the steps,
and from there into the ops as plain arguments (`traced`, `sync_free`, `exporting`). Below the layer nothing asks
again, but the ops' own device and dtype tests, and `side_by_side`, which checks its own thread's state.

`layer_call` wraps the layers' forwards (`MoE`, `SoftMoE`, `ImageFFNMoE`) for the tracers: under torch.fx symbolic
tracing the layer is one graph node, under a TorchScript trace it warns, once, in moespec's words.
"""

from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from typing import Callable, NamedTuple

import torch
from torch import fx, nn

from ...errors import MoespecError
from .backend import INSTALLED


def traced() -> bool:
    """Whether torch.export or torch.compile is tracing this call (torch < 2.3 has no such query)."""
    return getattr(torch.compiler, "is_compiling", lambda: False)()


def exporting() -> bool:
    """Whether torch.export is tracing this call: the flag `torch.compiler.is_exporting()` reads, read directly.
    torch 2.11's Dynamo answers the call itself with True under torch.compile too, and the MoE layers took the
    export path there (every expert on every item, no routing state, so `moespec.aux_loss` returned an
    earlier step's losses); torch 2.14 answers it right."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


_device_path_on_cpu = False


@contextmanager
def device_path():
    """Run the MoE layers' GPU path on CPU (static shapes, no host sync, the grouped step): how the tests see
    on a machine without a GPU what a GPU runs."""
    global _device_path_on_cpu
    before, _device_path_on_cpu = _device_path_on_cpu, True
    try:
        yield
    finally:
        _device_path_on_cpu = before


class Mode(NamedTuple):
    """How one layer call runs.

    Attributes:
        sync_free: the path that never waits for the device: static shapes, no host sync. On every device but the
            CPU, while torch.compile or torch.export traces, and on CPU inside `device_path()`; on CPU eagerly a
            host sync costs nothing and data-dependent shapes save work.
        exporting: torch.export traces: every expert on every item, combined densely, no routing state.
        traced: torch.compile or torch.export traces: the grouped matmuls go into the graph as `aten._grouped_mm`
            in 16 bits (`grouped.py`), no memory is kept between backwards (`gradient_memory`).
        scripted: a TorchScript trace runs (fvcore's `FlopCountAnalysis`): the plain ops and the loop, whose ops
            are then the work `moespec stats` counts.
        autocast: the dtype autocast computes matmuls in on the device, or None where autocast is off.
        kernels: moespec's Triton kernels can run on the device (CUDA, Triton installed).
        records: autograd records this call (a backward may follow): grad mode on and the input or a weight
            requires grad; never under a TorchScript trace, which cannot record the loop's `SegmentGraphs`.
        meta: the input is on the meta device: shapes without values, so that nothing may read one (a host sync);
            the sync-free path runs, and `ImageFFNMoE` its static one.
    """

    sync_free: bool = False
    exporting: bool = False
    traced: bool = False
    scripted: bool = False
    autocast: torch.dtype | None = None
    kernels: bool = False
    records: bool = False
    meta: bool = False

    @classmethod
    def of(cls, x: torch.Tensor, *weights: nn.Module | torch.Tensor | None) -> "Mode":
        """The mode of a call on `x` whose rows depend on `weights` (modules, whose parameters count, or tensors;
        None: absent) besides x."""
        device, compiling, scripted = x.device, traced(), torch.jit.is_tracing()
        records = torch.is_grad_enabled() and not scripted and (x.requires_grad or any(map(_requires_grad, weights)))
        return cls(sync_free=device.type != "cpu" or compiling or _device_path_on_cpu, exporting=exporting(),
                   traced=compiling, scripted=scripted, autocast=autocast_dtype(device),
                   kernels=INSTALLED and device.type == "cuda", records=records, meta=device.type == "meta")

    @property
    def pair_ops(self) -> bool:
        """Whether routing and the combine run as the pair ops (`pairs.py`: softmax_topk, sort_pairs, combine): on
        the sync-free path, but neither under a TorchScript trace nor while torch.export records (ONNX knows no
        custom op). On CPU eagerly the plain torch ops run, without a custom op's dispatch (0.1-0.6 ms a layer
        step at small sizes)."""
        return self.sync_free and not self.scripted and not self.exporting


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on `device`, or None where autocast is off or knows no such device
    (the meta device, on which `torch.is_autocast_enabled` raises)."""
    if not hasattr(torch, "get_autocast_dtype"):  # torch < 2.4: the layers' matmuls are autocast's own
        return None
    kind = device.type
    if not torch.amp.is_autocast_available(kind):
        return None
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _requires_grad(weights: nn.Module | torch.Tensor | None) -> bool:
    if isinstance(weights, nn.Module):
        return any(p.requires_grad for p in weights.parameters())
    return weights is not None and weights.requires_grad


def layer_call(*, fixes_routing: bool) -> Callable[[Callable], Callable]:
    """Decorates the forward of an MoE layer for the tracers.

    - torch.fx symbolic tracing (`torch.fx.symbolic_trace`, torchvision's `create_feature_extractor`, timm's FX
      feature extraction), whichever its tracer: the call is one `call_module` node, as a leaf module's is. Routing
      is Python on data-dependent shapes, which a Proxy cannot run; the graph module calls the layer itself.
    - a TorchScript trace (`torch.jit.trace`, fvcore): torch's TracerWarnings about the routing's data-dependent
      ops are silenced, and a layer that `fixes_routing` (its experts are chosen per input: not Soft MoE) warns,
      once, that the trace replays the example input's routing. The ops traced are those autograd differentiates
      whatever the grad mode, so that the graph runs with grad later, and `torch.jit.trace`'s check, which traces
      again under no_grad, finds the same graph.
    """

    def decorate(forward: Callable) -> Callable:
        @functools.wraps(forward)
        def call(layer: nn.Module, *args, **kwargs):
            proxy = next((a for a in (*args, *kwargs.values()) if isinstance(a, fx.Proxy)), None)
            if proxy is not None:
                return _leaf_node(proxy.tracer, layer, args, kwargs)
            if not torch.jit.is_tracing():
                return forward(layer, *args, **kwargs)
            if fixes_routing:
                _warn_trace_fixes_routing()
            with warnings.catch_warnings(), torch.enable_grad():
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                return forward(layer, *args, **kwargs)

        return call

    return decorate


def _leaf_node(tracer: fx.Tracer, layer: nn.Module, args: tuple, kwargs: dict) -> fx.Proxy:
    """The layer's call in the graph `tracer` builds, as a leaf module's: one `call_module` node."""
    path = tracer.path_of_module(layer) if layer is not tracer.root else ""
    if not path:
        raise MoespecError(f"torch.fx cannot trace a {type(layer).__name__} layer on its own: its routing depends on "
                           f"the data. Trace the model that holds it (the layer is one node of its graph), or export "
                           f"the layer with torch.export.export(layer, (x,))")
    return tracer.create_proxy("call_module", path, args, kwargs)


TRACE_WARNING = ("moespec: a TorchScript trace (torch.jit.trace) fixes the routing of its example input: the traced "
                 "graph keeps how many items each expert got, and computes another function on an input that routes "
                 "otherwise. Export the model with torch.export.export(model, (x,)) instead, whose graph routes each "
                 "input (torch.onnx.export(model, (x,), dynamo=True) for ONNX)")
_warned_trace = False


def _warn_trace_fixes_routing() -> None:
    """The TorchScript trace's one warning, once a process (a trace calls every MoE layer, and
    `torch.jit.trace` traces twice)."""
    global _warned_trace
    if not _warned_trace:
        _warned_trace = True
        warnings.warn(TRACE_WARNING, UserWarning, stacklevel=2)

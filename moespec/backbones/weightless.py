"""A dense backbone without weight storage, for counting: its parameters have their shapes and dtypes but one
element of memory each, its buffers are real.

Counting reads a parameter's shape, dtype and numel, and fvcore's trace runs the forward on real tensors: the
meta device does not do (its convolution refuses the jit tracer's shapes), and buffers may hold values the
forward needs (index tables such as Swin's `relative_position_index`). So the model is built with every
parameter moved to the meta device as it is registered (timm's initialization then costs nothing), buffers
built as usual, and each parameter then becomes a zero-stride view of a single zero on the CPU. ViT-H/14's
632M parameters take 2.4 GiB as real weights, and nothing this way. The forward computes on zeros; counts never
depend on values (the trace input is zeros already). A matmul or a convolution copies the view it multiplies
into a contiguous weight for the length of the op, so a trace peaks at about the largest parameter (ViT-H/14:
26 MB). The backbone is still refused, as a real build is, when its weights would not fit in memory.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ..spec import Spec
from .create import create_backbone


def create_weightless_backbone(spec: Spec) -> nn.Module:
    """The spec's dense backbone on the CPU, every parameter a zero-stride view of one zero (no gradient); for
    counting parameters and tracing MACs, never for computing. Tied parameters stay tied.

    A model that derives tensors from its parameters while it is built (Swin makes its attention mask on
    `norm1.weight.device`), or cannot be built with them on the meta device, is built with real weights
    first (errors are then timm's own); its parameters become views all the same."""
    try:
        with _parameters_on_meta():
            model = create_backbone(spec)
    except Exception:  # SwinV2 copies a meta tensor into a buffer (a SpecError when the spec has kwargs): the
        model = None   # real build below reports what is wrong, if anything is (a spec error, a size refusal)
    if model is None or _holds_meta_tensors(model):
        model = create_backbone(spec)
    views: dict[int, nn.Parameter] = {}  # by id: a tied parameter gets one view
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                if id(param) not in views:
                    views[id(param)] = nn.Parameter(torch.zeros((), dtype=param.dtype).expand(param.shape),
                                                    requires_grad=False)
                module._parameters[name] = views[id(param)]
    return model


def _holds_meta_tensors(model: nn.Module) -> bool:
    """A buffer or a plain tensor attribute on the meta device: made from a parameter while it was there."""
    return any(isinstance(value, torch.Tensor) and value.device.type == "meta"
               for module in model.modules() for value in (*module._buffers.values(), *vars(module).values()))


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While it lasts, every parameter a module registers goes to the meta device (one already there, such as a
    tied parameter, is kept as it is); buffers are untouched. Patches `nn.Module.register_parameter`, which
    `nn.Module.__setattr__` calls, as accelerate's `init_empty_weights(include_buffers=False)` does: no other
    thread may build modules meanwhile."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register

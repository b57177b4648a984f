"""What one forward on the CPU can afford. A count (`stats`), upcycling's logit check and `inspect` run the
model on real tensors, so an input size the schema allows (16,384 px a side) can take more memory and time than
the machine has: a ViT's attention over a million tokens, or a ConvNeXt's 26 GB stage-1 activations. Before any
such forward, the dense forward is run on the meta device, where it allocates and computes nothing, and
measured: the MACs of its matmul-like ops (torch's `FlopCounterMode`) and the peak bytes of its live tensors.
A forward over either bound is refused (or, where the caller has a cheaper way, such as upcycling's per-layer
check, not run).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from rich.filesize import decimal
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from ..backbones import create_backbone, placement
from ..backbones.placement import MEMORY_SHARE
from ..errors import SpecError
from ..spec import Spec, spec_problem
from .checks import input_refusal, input_size_error

MAX_FORWARD_MACS = 4 * 10**12
"""MACs of one forward that moespec may run: 24 x ViT-H/14 at 224 px (167 G), above SAM's ViT-H at 1,024 px
(about 3 T, the largest input in timm); at tens of GMAC/s on a CPU, a minute or more."""


class LiveBytes(TorchDispatchMode):
    """While active, the peak bytes of the tensors that ops return and that are still referenced (each storage
    once; on the meta device nothing is allocated, but the sizes are the real forward's)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage -> [bytes, tensors referencing it]
        self.current = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._hold(tensor)
        return out

    def _hold(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [storage.nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]
            self.current -= entry[0]


def forward_cost_problem(spec: Spec, input_size: tuple[int, int, int], *, batch: int = 1, held_bytes: int = 0,
                         runner: str = "a forward") -> str | None:
    """Why a forward of `spec`'s dense backbone on `batch` inputs of `input_size` on the CPU is more than this
    machine affords, with `held_bytes` more held beside it (a batch's images): "about X TMACs, more than the
    4 T {runner} runs" or "about X of activations, more than 80% of this machine's memory (Y)"; None when it
    fits. A model that does not take that input at all is a SpecError at `input_size` saying why (the forward
    would fail)."""
    model = create_backbone(spec, device="meta")
    # No gradients: FlopCounterMode's module tracker hooks the inputs that require grad, and fails ("Expected
    # gradient function to be set") on a view of a parameter under no_grad: a MAP head's latent query
    # (SoViT-400m's `attn_pool.latent.expand(B, -1, -1)`). A shape-only forward needs no autograd anyway.
    model.requires_grad_(False)
    live, flops = LiveBytes(), FlopCounterMode(display=False)
    with flops, live:
        refusal = input_refusal(model, input_size, batch=batch)
    if refusal is not None:
        raise input_size_error(spec, input_size, refusal, batch=batch, step="measuring the forward's cost")
    macs, allowed = flops.get_total_flops() // 2, int(MEMORY_SHARE * placement.device_memory(torch.device("cpu")))
    peak = live.peak + held_bytes
    if macs > MAX_FORWARD_MACS:
        return f"about {macs / 1e12:,.1f} TMACs, more than the {MAX_FORWARD_MACS / 1e12:g} T {runner} runs"
    if peak > allowed:
        return (f"about {decimal(peak)} of activations, more than {MEMORY_SHARE:.0%} of this machine's memory "
                f"({decimal(allowed)})")
    return None


def refuse_costly_forward(spec: Spec, input_size: tuple[int, int, int], what: str, *, batch: int = 1,
                          held_bytes: int = 0, runner: str = "a forward", hint: str = "use a smaller input size"
                          ) -> None:
    """A SpecError at `input_size` when `forward_cost_problem` finds one: "{what} at input size [...] runs
    the forward on the CPU: {problem}; {hint}"."""
    problem = forward_cost_problem(spec, input_size, batch=batch, held_bytes=held_bytes, runner=runner)
    if problem is not None:
        raise SpecError(spec_problem(spec, "input_size", f"{what} at input size {list(input_size)} runs the forward "
                                                         f"on the CPU: {problem}; {hint}"))

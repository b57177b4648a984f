"""What a count can afford: `count_macs` runs the forward at batch 1 on the CPU (fvcore traces real tensors), so an
input size the schema allows (16,384 px a side) can take more memory and time than the machine has: a ViT's
attention over a million tokens, or a ConvNeXt's 26 GB stage-1 activations. Before the trace, the dense forward is
run on the meta device, where it allocates and computes nothing, and measured: the MACs of its matmul-like ops
(torch's `FlopCounterMode`) and the peak bytes of its live tensors. A count over either bound is refused.
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
from ..planning import input_refusal
from ..spec import Spec, spec_problem

MAX_COUNTED_MACS = 4 * 10**12
"""MACs of one forward that a count may run: 24 x ViT-H/14 at 224 px (167 G), above SAM's ViT-H at 1,024 px (about
3 T, the largest input in timm); at tens of GMAC/s on a CPU, a minute or more."""


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


def refuse_uncountable(spec: Spec, input_size: tuple[int, int, int]) -> None:
    """Refuse (a SpecError at `input_size`) a count whose forward at batch 1 would need more than
    `MAX_COUNTED_MACS` or more than `MEMORY_SHARE` of this machine's memory for its activations."""
    model = create_backbone(spec, device="meta")
    live, flops = LiveBytes(), FlopCounterMode(display=False)
    with flops, live:
        if input_refusal(model, input_size) is not None:
            return  # the count reports why the model does not take it
    macs, allowed = flops.get_total_flops() // 2, int(MEMORY_SHARE * placement.device_memory(torch.device("cpu")))
    if macs <= MAX_COUNTED_MACS and live.peak <= allowed:
        return
    over = (f"about {macs / 1e12:,.1f} TMACs, more than the {MAX_COUNTED_MACS / 1e12:g} T a count runs"
            if macs > MAX_COUNTED_MACS else
            f"about {decimal(live.peak)} of activations, more than {MEMORY_SHARE:.0%} of this machine's memory "
            f"({decimal(allowed)})")
    raise SpecError(spec_problem(spec, "input_size", f"counting MACs at input size {list(input_size)} runs the "
                                                     f"forward on the CPU: {over}; use a smaller input size"))

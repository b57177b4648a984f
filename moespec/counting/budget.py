"""What a count can afford: `count_macs` runs the forward at batch 1 on the CPU (fvcore traces real tensors), so
it is refused first where that forward is more than the machine affords (`planning.forward_cost`)."""

from __future__ import annotations

from ..planning.forward_cost import MAX_FORWARD_MACS, LiveBytes, refuse_costly_forward
from ..spec import Spec

MAX_COUNTED_MACS = MAX_FORWARD_MACS
__all__ = ["MAX_COUNTED_MACS", "LiveBytes", "refuse_uncountable"]


def refuse_uncountable(spec: Spec, input_size: tuple[int, int, int]) -> None:
    """Refuse (a SpecError at `input_size`) a count whose forward at batch 1 would need more than
    `MAX_COUNTED_MACS` or more than `MEMORY_SHARE` of this machine's memory for its activations."""
    refuse_costly_forward(spec, input_size, "counting MACs", runner="a count")

"""The padded step: the rows scattered into a zero-padded [E, largest segment, C] batch and two `bmm`s (reads
the largest segment on the host)."""

from __future__ import annotations

import torch

from ..ops.mode import Mode
from .base import ExpertStep
from .rows import Segments


class PaddedStep(ExpertStep):
    name = "padded"

    def run(self, bank, x: torch.Tensor, segments: Segments, groups: torch.Tensor | None, mode: Mode) -> torch.Tensor:
        """Rows scattered into a zero-padded [E, M, C] batch (M = the largest segment), batched expert, gathered
        back. Padding rows get zero gradient: their outputs are never gathered."""
        counts = segments.counts
        expert = segments.expert_of_rows(x.shape[0])
        slot = torch.arange(x.shape[0], device=x.device) - (torch.cumsum(counts, 0) - counts)[expert]
        width = int(counts.max()) if x.shape[0] else 0
        padded = x.new_zeros(bank.local_experts, width, x.shape[1]).index_put((expert, slot), x)
        return bank.stacked(padded, mode)[expert, slot]

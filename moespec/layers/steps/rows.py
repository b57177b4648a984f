"""What routing hands the expert steps: one description of the routed rows, and how the layer call runs.

The (item, expert) pairs of one forward are sorted by expert: expert e's segment is rows [ends[e-1], ends[e]),
`counts[e]` rows long. Pairs that a capacity or a drop left out follow the last segment with weight 0, so that
every item keeps its k rows (`position`) and, on a GPU or under torch.compile, no shape depends on the data;
their outputs are 0. The steps read all of it here (`Segments`, `RoutedRows`, with the call's `Mode`), and none
takes a flag of its own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..ops.mode import Mode


class Segments(NamedTuple):
    """Rows sorted by expert: `counts` [E] rows per expert, one segment after another; with `dropped`, rows past
    the last segment follow (pairs a capacity or a drop left out), whose outputs are 0."""

    counts: torch.Tensor
    dropped: bool = False
    offsets: torch.Tensor | None = None  # `ends()`, where routing computed it (`ops.pairs.sort_pairs`)
    row_expert: torch.Tensor | None = None  # `expert_of_rows()`, likewise

    def ends(self) -> torch.Tensor:
        """[E] int32 end of each expert's segment (the offsets of grouped matmuls), on the device."""
        if self.offsets is not None:
            return self.offsets
        return torch.cumsum(self.counts, 0).to(torch.int32)

    def expert_of_rows(self, rows: int) -> torch.Tensor:
        """[rows] expert of each row; E (one past the last expert) for a dropped row. No host sync."""
        if self.row_expert is not None and self.row_expert.shape[0] == rows:
            return self.row_expert
        experts = self.counts.numel()
        if self.dropped:
            return torch.bucketize(torch.arange(rows, device=self.counts.device), self.ends(), right=True)
        return torch.repeat_interleave(torch.arange(experts, device=self.counts.device), self.counts,
                                       output_size=rows)

    def per_row(self, param: torch.Tensor | None, expert: torch.Tensor) -> torch.Tensor | None:
        """param [E, ...] of each row's expert (`expert_of_rows`); zeros for a dropped row."""
        if param is None:
            return None
        return (F.pad(param, (0, 0, 0, 1)) if self.dropped else param).index_select(0, expert)

    def kept(self, rows: int) -> int:
        """The rows in segments (reads the counts on the host where rows were dropped)."""
        return int(self.counts.sum()) if self.dropped else rows


class RoutedRows(NamedTuple):
    """The routed pairs of one forward, as the MoE layer hands them to its experts.

    Attributes:
        item: [P] the item of each row (the order: rows sorted by expert).
        weights: [P] the gate each row's output is scaled by (0 for a dropped row).
        segments: the experts' segments and whether dropped rows follow them.
        mode: how the layer call runs (`ops.mode.Mode`), decided at the top of its forward.
        position: [T, k] the row of each of an item's k choices, where every item makes k (token choice, image
            routing); None elsewhere (expert choice). With it, each item's outputs are gathered and summed,
            never scatter-added.
        gates: [T, k] the gate of each choice (weights in choice order), where routing has them so (plain top-k
            on the sync-free path): the combine reads them there, with no gather and no scatter in its gradient.
        choices: [T, k] the expert of each choice, likewise.
    """

    item: torch.Tensor
    weights: torch.Tensor
    segments: Segments
    mode: Mode
    position: torch.Tensor | None = None
    gates: torch.Tensor | None = None
    choices: torch.Tensor | None = None

    @property
    def counts(self) -> torch.Tensor:
        return self.segments.counts

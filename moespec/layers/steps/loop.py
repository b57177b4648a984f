"""The loop step: each expert's whole FFN on its contiguous segment in turn, its hidden activations in cache
(under autograd, a small graph per segment: `SegmentGraphs`); the only step for GRN experts."""

from __future__ import annotations

import torch

from ..expert_autograd import SegmentGraphs, expert_segments
from ..rows import RoutedRows, Segments
from .base import ExpertStep, gather_sum, scaled, scatter_weighted


class LoopStep(ExpertStep):
    name = "loop"

    def run(self, bank, x: torch.Tensor, segments: Segments, groups: torch.Tensor | None) -> torch.Tensor:
        """Each expert's whole FFN on its own segment in turn (one host sync for the counts): its hidden
        activations ([rows, H], a few MB) stay in cache from fc1 to fc2 instead of [S, H] tensors going through
        memory between every op. Under autograd each segment is a small graph of its own (`SegmentGraphs`).
        GRN normalizes over each image's rows within a segment, which are one expert's."""
        counts = segments.counts.tolist()
        if bank._records_graph(x):
            return SegmentGraphs.apply(x, bank, counts, groups, *bank._param_list())
        params = [bank._unbind(p) for p in bank._param_list()]
        out = x.new_empty(x.shape[0], bank.out_features)
        for e, rows in expert_segments(counts):
            one = [p[e] if p is not None else None for p in params]
            out[rows] = bank._expert(x[rows], one, groups[rows] if groups is not None else None)
        return out

    def combine(self, bank, items: torch.Tensor, rows: RoutedRows, groups: torch.Tensor | None) -> torch.Tensor | None:
        """Where autograd records nothing (and the bank holds its experts: `Experts.runs_segmentwise`), `combine`
        one expert segment at a time: no [P, C] gathered rows, and each segment's outputs scaled while they are
        in cache (as transformers' eager Mixtral block does it). Where each item's k rows are known (`position`),
        the outputs go to their rows and each item gathers and sums its k rows; elsewhere they are added into
        their items (a scatter-add)."""
        if not bank.runs_segmentwise(items):
            return None
        params = [bank._unbind(p) for p in bank._param_list()]
        total = rows.item.shape[0]
        out = y = None
        kept = 0
        for e, segment in expert_segments(rows.counts.tolist()):
            index = rows.item[segment]
            one = bank._expert(items.index_select(0, index), [p[e] if p is not None else None for p in params],
                               groups.index_select(0, index) if groups is not None else None)
            one = scaled(one, rows.weights[segment].unsqueeze(-1))
            if rows.position is not None:
                if out is None:
                    out = one.new_empty(total, one.shape[-1])
                out[segment], kept = one, segment.stop
            else:
                if y is None:
                    y = one.new_zeros(items.shape[0], one.shape[-1])
                y.index_add_(0, index, one)
        if out is not None:
            out[kept:] = 0  # the dropped rows
            return gather_sum(out, rows.position)
        if y is None:  # no pair: the empty outputs' dtype, as the other steps give it
            return scatter_weighted(items.new_empty(0, bank.out_features), rows.item[:0], rows.weights[:0],
                                    items.shape[0])
        return y

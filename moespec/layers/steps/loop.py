"""The loop step: each expert's whole FFN on its contiguous segment in turn, its hidden activations in cache
(under autograd, a small graph per segment: `SegmentGraphs`); the only step for GRN experts."""

from __future__ import annotations

import torch

from ..expert_autograd import SegmentGraphs, expert_segments
from .base import ExpertStep, scaled, scatter_weighted


class LoopStep(ExpertStep):
    name = "loop"

    def run(self, bank, x: torch.Tensor, counts: torch.Tensor, groups: torch.Tensor | None,
            tail: bool) -> torch.Tensor:
        """Each expert's whole FFN on its own segment in turn (one host sync for the counts): its hidden
        activations ([rows, H], a few MB) stay in cache from fc1 to fc2 instead of [S, H] tensors going through
        memory between every op. Under autograd each segment is a small graph of its own (`SegmentGraphs`).
        GRN normalizes over each image's rows within a segment, which are one expert's."""
        segments = counts.tolist()
        if bank._records_graph(x):
            return SegmentGraphs.apply(x, bank, segments, groups, *bank._param_list())
        params = [bank._unbind(p) for p in bank._param_list()]
        out = x.new_empty(x.shape[0], bank.out_features)
        for e, rows in expert_segments(segments):
            one = [p[e] if p is not None else None for p in params]
            out[rows] = bank._expert(x[rows], one, groups[rows] if groups is not None else None)
        return out

    def combine(self, bank, items: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor,
                groups: torch.Tensor | None, position: torch.Tensor | None, tail: bool) -> torch.Tensor | None:
        """Where autograd records nothing (and the bank holds its experts: `Experts.runs_segmentwise`), `combine`
        one expert segment at a time: no [P, C] gathered rows or outputs, and no pass over them to scale and
        scatter (as transformers' eager Mixtral block does it)."""
        if not bank.runs_segmentwise(items):
            return None
        params = [bank._unbind(p) for p in bank._param_list()]
        y = None
        for e, segment in expert_segments(counts.tolist()):
            index = rows[segment]
            out = bank._expert(items.index_select(0, index), [p[e] if p is not None else None for p in params],
                               groups.index_select(0, index) if groups is not None else None)
            out = scaled(out, weights[segment].unsqueeze(-1))
            if y is None:
                y = out.new_zeros(items.shape[0], out.shape[-1])
            y.index_add_(0, index, out)
        if y is None:  # no pair: the empty outputs' dtype, as the other steps give it
            return scatter_weighted(items.new_empty(0, bank.out_features), rows, weights, items.shape[0])
        return y


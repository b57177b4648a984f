"""The loop step: each expert's whole FFN on its contiguous segment in turn, its hidden activations in cache
(under autograd, a small graph per segment: `SegmentGraphs`); the only step for GRN experts."""

from __future__ import annotations

import threading

import torch

from ..ops.expert_autograd import SegmentGraphs, expert_segments
from ..ops.mode import Mode
from ..ops.side_by_side import each_segment
from .base import ExpertStep, scaled, scatter_weighted, weighted_sum
from .rows import RoutedRows, Segments


class LoopStep(ExpertStep):
    name = "loop"

    def run(self, bank, x: torch.Tensor, segments: Segments, groups: torch.Tensor | None, mode: Mode) -> torch.Tensor:
        """Each expert's whole FFN on its own segment in turn (one host sync for the counts): its hidden
        activations ([rows, H], a few MB) stay in cache from fc1 to fc2 instead of [S, H] tensors going through
        memory between every op. Under autograd each segment is a small graph of its own (`SegmentGraphs`).
        GRN normalizes over each image's rows within a segment, which are one expert's."""
        counts = segments.counts.tolist()
        if mode.records:
            return SegmentGraphs.apply(x, bank.ffn, bank.out_features, bank.hidden, counts, groups, mode.traced,
                                       *bank.params())
        params = _unbound(bank)
        out = x.new_empty(x.shape[0], bank.out_features)

        def expert(e, rows):  # on one thread, side by side with the other segments (`side_by_side`)
            one = [p[e] if p is not None else None for p in params]
            out[rows] = bank.ffn(x[rows], one, groups[rows] if groups is not None else None)

        each_segment(expert, expert_segments(counts), bank.hidden, device=x.device)
        return out

    def combine(self, bank, items: torch.Tensor, rows: RoutedRows, groups: torch.Tensor | None) -> torch.Tensor | None:
        """Where autograd records nothing and the bank holds its experts (its transport is local), `combine`
        with the fewest passes: where each item's k rows are known (`position`), the rows gathered once, each
        expert's whole FFN on its segment in turn, and each item's k outputs gathered, weighted and summed
        (`weighted_sum`): no op per segment but the FFN's own, which matters on a busy CPU, where every op's
        threads wait for each other. Elsewhere (expert choice), each segment's rows gathered, run, weighted and
        added into their items in turn, while they are in cache (as transformers' eager Mixtral block does it)."""
        if rows.mode.records or not bank.transport.local:
            return None
        params = _unbound(bank)
        segments = list(expert_segments(rows.counts.tolist()))
        if rows.position is not None and segments:
            out, lock = [None], threading.Lock()

            def expert(e, segment):  # the segment's rows gathered, run and written, on one thread (`side_by_side`)
                index = rows.item[segment]
                y = bank.ffn(items.index_select(0, index), [p[e] if p is not None else None for p in params],
                             groups.index_select(0, index) if groups is not None else None)
                with lock:
                    if out[0] is None:  # the experts' output dtype (autocast's, or the items')
                        out[0] = y.new_empty(rows.item.shape[0], y.shape[-1])
                out[0][segment] = y

            each_segment(expert, segments, bank.hidden, device=items.device)
            out[0][segments[-1][1].stop:] = 0  # the dropped rows
            return weighted_sum(out[0], rows)
        y = None
        for e, segment in segments:
            index = rows.item[segment]
            one = bank.ffn(items.index_select(0, index), [p[e] if p is not None else None for p in params],
                           groups.index_select(0, index) if groups is not None else None)
            one = scaled(one, rows.weights[segment].unsqueeze(-1))
            if y is None:
                y = one.new_zeros(items.shape[0], one.shape[-1])
            y.index_add_(0, index, one)
        if y is None:  # no pair: the empty outputs' dtype, as the other steps give it
            return scatter_weighted(items.new_empty(0, bank.out_features), rows.item[:0], rows.weights[:0],
                                    items.shape[0])
        return y


def _unbound(bank) -> list:
    """The bank's parameters, each unbound into its experts' slices (None where absent)."""
    return [p.unbind(0) if p is not None else None for p in bank.params()]

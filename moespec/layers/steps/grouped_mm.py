"""The grouped_mm step: grouped matmuls over the jagged per-expert segments (`grouped.segment_mm`, torch's
`F.grouped_mm`), static shapes and no host sync: the step of every device but the CPU and of torch.compile."""

from __future__ import annotations

import torch

from ..dispatch import autocast_dtype, sync_free
from ..expert_autograd import CombinePairs, ExpertLinear, GatherPairs
from ..routing import inverse_permutation
from ..rows import RoutedRows, Segments
from .base import ExpertStep


class GroupedStep(ExpertStep):
    name = "grouped_mm"
    static_shapes = True

    def run(self, bank, x: torch.Tensor, segments: Segments, groups: torch.Tensor | None) -> torch.Tensor:
        """Grouped matmuls over the jagged segments (`grouped.segment_mm`): static shapes, and the offsets stay
        on the device (no host sync). Under autocast the rows and weights go in autocast's dtype, as they would
        through `F.linear` (autocast does not cast a custom op's inputs)."""
        expert = segments.expert_of_rows(x.shape[0])
        w1, b1, norm_w, norm_b, w2, b2 = bank._param_list()
        cast = autocast_dtype(x.device)
        if cast is not None:
            x, w1, b1, w2, b2 = [None if t is None else t.to(cast) for t in (x, w1, b1, w2, b2)]
        norm = [segments.per_row(p, expert) for p in (norm_w, norm_b)]
        return bank._expert(x, [w1, b1, *norm, w2, b2], None, linear=_segment_linear(segments, expert))

    def combine(self, bank, items: torch.Tensor, rows: RoutedRows, groups: torch.Tensor | None) -> torch.Tensor | None:
        """`combine` on the sync-free path, when each item has k rows (`position`; not for a bank whose rows
        travel to other ranks, `Experts.fuses_pairs`): its passes over the rows are the gather, the two grouped
        matmuls, the activation and the combine. fc1's bias rides as one more input column (items
        [T, C | 1 0..], weights [E, H, C | bias 0..], padded to 16 bytes), so that no [P, H] tensor of biases is
        gathered and added; fc2's bias is folded into the combine (`CombinePairs`; not under output dropout,
        which it precedes). The gather and the combine go back by gathers (`GatherPairs`, `CombinePairs`), not
        atomic scatter-adds. On CPU eagerly the bank gathers and combines (`base.gathered`, `base.combined`)."""
        if not bank.fuses_pairs(rows.position) or not sync_free(items.device):
            return None
        segments, position = rows.segments, rows.position
        expert = segments.expert_of_rows(rows.item.shape[0])
        w1, b1, norm_w, norm_b, w2, b2 = bank._param_list()
        dtype = autocast_dtype(items.device) or w1.dtype
        if b1 is not None:
            items, w1 = _with_bias_column(items, w1, b1, dtype)
        else:
            items, w1 = items.to(dtype), w1.to(dtype)
        fold = b2 is not None and not (bank.training and bank.drop[1] > 0)
        w2, b2 = w2.to(dtype), None if b2 is None else b2.to(dtype)
        x = GatherPairs.apply(items, rows.item, position)
        norm = [segments.per_row(p, expert) for p in (norm_w, norm_b)]
        out = bank._expert(x, [w1, None, *norm, w2, None if fold else b2], None,
                           linear=_segment_linear(segments, expert))
        tokens, k = position.shape
        flat = position.reshape(-1)
        choice_weights = rows.weights.index_select(0, flat).view(tokens, k)
        choice_experts = expert.clamp(max=bank.local_experts - 1).index_select(0, flat).view(tokens, k)
        order = inverse_permutation(flat)  # sorted row -> t * k + j
        return CombinePairs.apply(out, choice_weights, position, order, choice_experts, b2 if fold else None)


def _segment_linear(segments: Segments, expert: torch.Tensor):
    offsets = segments.ends()

    def linear(h, weight, bias):
        return ExpertLinear.apply(h.to(weight.dtype), weight, bias, offsets, expert, segments.dropped)

    return linear


def _with_bias_column(items: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """items [T, C] and weight [E, H, C], bias [E, H] as [T, C + n] = [items | 1 1 ..] and [E, H, C + n] =
    [weight | bias 0 ..] in `dtype` (n: 16 bytes of it), so that x @ w.T is items @ weight.T + bias. The items
    are cast and copied in one pass."""
    extra = max(1, 16 // dtype.itemsize)
    width = items.shape[-1]
    augmented = items.new_ones(items.shape[0], width + extra, dtype=dtype)
    augmented[:, :width] = items
    columns = [weight.to(dtype), bias.to(dtype).unsqueeze(-1), weight.new_zeros(*weight.shape[:2], extra - 1,
                                                                               dtype=dtype)]
    return augmented, torch.cat(columns, dim=-1)

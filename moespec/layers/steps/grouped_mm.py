"""The grouped_mm step: grouped matmuls over the jagged per-expert segments (`grouped.segment_mm`, torch's
`F.grouped_mm`), static shapes and no host sync: the step of every device but the CPU and of torch.compile."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dispatch import autocast_dtype
from ..expert_autograd import CombinePairs, ExpertLinear, GatherPairs
from ..routing import inverse_permutation
from .base import ExpertStep


class GroupedStep(ExpertStep):
    name = "grouped_mm"
    static_tail = True

    def run(self, bank, x: torch.Tensor, counts: torch.Tensor, groups: torch.Tensor | None,
            tail: bool) -> torch.Tensor:
        """Grouped matmuls over the jagged segments (`grouped.segment_mm`): static shapes, and the offsets stay
        on the device (no host sync). Under autocast the rows and weights go in autocast's dtype, as they would
        through `F.linear` (autocast does not cast a custom op's inputs)."""
        offsets, expert = _segments(bank, counts, x.shape[0], tail)
        w1, b1, norm_w, norm_b, w2, b2 = bank._param_list()
        cast = autocast_dtype(x.device)
        if cast is not None:
            x, w1, b1, w2, b2 = [None if t is None else t.to(cast) for t in (x, w1, b1, w2, b2)]
        return bank._expert(x, [w1, b1, *_rowwise(norm_w, norm_b, expert, tail), w2, b2], None,
                            linear=_segment_linear(offsets, expert, tail))

    def combine(self, bank, items: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor,
                groups: torch.Tensor | None, position: torch.Tensor | None, tail: bool) -> torch.Tensor | None:
        """`combine` on the sync-free path, when each item has k pairs (`position` [T, k]; None: not fused,
        nor for a bank that does not gather its pairs, `Experts.fuses_pairs`): its passes over
        the rows are the gather, the two grouped matmuls, the activation and the combine. fc1's bias rides
        as one more input column (items [T, C | 1 0..], weights [E, H, C | bias 0..], padded to 16 bytes), so
        that no [P, H] tensor of biases is gathered and added; fc2's bias is folded into the combine
        (`CombinePairs`; not under output dropout, which it precedes). The gather and the combine go back by
        gathers (`GatherPairs`, `CombinePairs`), not atomic scatter-adds."""
        if not bank.fuses_pairs(position):
            return None
        offsets, expert = _segments(bank, counts, rows.shape[0], tail)
        w1, b1, norm_w, norm_b, w2, b2 = bank._param_list()
        dtype = autocast_dtype(items.device) or w1.dtype
        if b1 is not None:
            items, w1 = _with_bias_column(items, w1, b1, dtype)
        else:
            items, w1 = items.to(dtype), w1.to(dtype)
        fold = b2 is not None and not (bank.training and bank.drop[1] > 0)
        w2, b2 = w2.to(dtype), None if b2 is None else b2.to(dtype)
        x = GatherPairs.apply(items, rows, position)
        out = bank._expert(x, [w1, None, *_rowwise(norm_w, norm_b, expert, tail), w2, None if fold else b2],
                           None, linear=_segment_linear(offsets, expert, tail))
        tokens, k = position.shape
        flat = position.reshape(-1)
        choice_weights = weights.index_select(0, flat).view(tokens, k)
        choice_experts = expert.clamp(max=bank.local_experts - 1).index_select(0, flat).view(tokens, k)
        order = inverse_permutation(flat)  # sorted row -> t * k + j
        return CombinePairs.apply(out, choice_weights, position, order, choice_experts, b2 if fold else None)


def _segments(bank, counts: torch.Tensor, rows: int, tail: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The int32 segment ends [E] and the expert of each of `rows` rows [S] (E for a tail row)."""
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    if tail:
        return offsets, torch.bucketize(torch.arange(rows, device=counts.device), offsets, right=True)
    return offsets, torch.repeat_interleave(torch.arange(bank.local_experts, device=counts.device), counts,
                                            output_size=rows)

def _rowwise(norm_w: torch.Tensor | None, norm_b: torch.Tensor | None, expert: torch.Tensor,
             tail: bool) -> list[torch.Tensor | None]:
    """The inner norm's parameters of each row's expert; a tail row's (expert E) are 0."""
    return [None if p is None else (F.pad(p, (0, 0, 0, 1)) if tail else p).index_select(0, expert)
            for p in (norm_w, norm_b)]

def _segment_linear(offsets: torch.Tensor, expert: torch.Tensor, tail: bool):
    def linear(h, weight, bias):
        return ExpertLinear.apply(h.to(weight.dtype), weight, bias, offsets, expert, tail)

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

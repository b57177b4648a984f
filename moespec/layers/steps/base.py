"""The interface every expert step implements (one file per step beside this one; the table in `__init__.py`),
and the gather and the combine around a step that does not fuse them."""

from __future__ import annotations

import torch

from ..ops.expert_autograd import CombinePairs, GatherPairs
from ..ops.mode import Mode
from ..ops.pairs import inverse_permutation
from ..ops.side_by_side import each
from .rows import RoutedRows, Segments


class ExpertStep:
    """One way to run an expert bank (`bank.ExpertBank`) on its routed rows: all steps compute the same function.

    `run` takes the rows sorted by expert as `Segments` describes them, in a call that runs as `mode` says; a
    dropped row's output is 0. A step whose shapes must stay static runs the dropped rows itself
    (`static_shapes`); for the others the bank runs the segments' rows and pads the rest with 0. `combine` may
    gather the routed pairs' rows and combine their outputs itself, around its matmuls; None: the bank gathers,
    runs and combines (`gathered`, `combined`)."""

    name: str
    static_shapes = False  # runs the rows past the segments itself, with no host sync

    def unavailable(self, bank, like: torch.Tensor, mode: Mode) -> str | None:
        """Why this step cannot run `bank` on rows like `like` (device, dtype, training mode), or None."""
        return None

    def run(self, bank, x: torch.Tensor, segments: Segments, groups: torch.Tensor | None, mode: Mode) -> torch.Tensor:
        """[S, C'] outputs of rows x [S, C] sorted by expert."""
        raise NotImplementedError

    def combine(self, bank, items: torch.Tensor, rows: RoutedRows, groups: torch.Tensor | None) -> torch.Tensor | None:
        """[T, C'] the weighted sum of each item's expert outputs, where this step gathers and combines the pairs
        itself (`Experts.combine`'s arguments); None where it does not."""
        return None


def scaled(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out * weights, in place when autograd does not need `out` and the product keeps its dtype (under autocast
    the experts give bfloat16 and the gate weights are float32): one buffer less to allocate."""
    in_place = not (out.requires_grad or weights.requires_grad) and out.dtype == weights.dtype
    return out.mul_(weights) if in_place else out * weights


def gathered(items: torch.Tensor, rows: RoutedRows) -> torch.Tensor:
    """[P, C] the item of each routed row. Where each item's k rows are known (`position`), its backward sums
    them by a gather (`GatherPairs`), not by index_select's scatter-add."""
    if rows.position is None:
        return items.index_select(0, rows.item)  # not items[rows]: faster on CPU, and so is its backward
    return GatherPairs.apply(items, rows.item, rows.position, rows.mode.sync_free)


def combined(out: torch.Tensor, rows: RoutedRows, tokens: int) -> torch.Tensor:
    """[tokens, C'] the sum over each item's rows of weight * out (out [P, C'] in row order): a gather of each
    item's k rows and a sum where `position` gives them (forward and backward by gathers), else a scatter-add.
    On a busy CPU a scatter-add's cost explodes (its threads wait for each other); a gather's does not."""
    if rows.position is None:
        return scatter_weighted(out, rows.item, rows.weights, tokens)
    if not (torch.is_grad_enabled() and (out.requires_grad or rows.weights.requires_grad)):
        return weighted_sum(out, rows)  # each product rounded, then summed: as the scatter-add summed them
    position = rows.position
    flat = position.reshape(-1)
    weights = rows.weights.index_select(0, flat).view(position.shape)
    return CombinePairs.apply(out, weights, position, inverse_permutation(flat), None, None)


def weighted_sum(out: torch.Tensor, rows: RoutedRows) -> torch.Tensor:
    """[T, C'] sum over j of weights[r] * out[r], r = position[t, j] the rows of item t: one gather, product and
    sum per choice (the products as `scaled` makes them, each rounded before the sum). Where autograd records
    nothing, into one buffer, in spans of items side by side on a CPU with threads to spare (`side_by_side`);
    where it records (the gates of frozen experts), in one span."""
    position, weights = rows.position, rows.weights
    tokens, k = position.shape
    records = torch.is_grad_enabled() and (out.requires_grad or weights.requires_grad)
    y = None if records else out.new_empty(tokens, out.shape[-1], dtype=torch.promote_types(out.dtype, weights.dtype))

    def span(items: slice):
        acc = None
        for j in range(k):
            at = position[items, j]
            product = scaled(out.index_select(0, at), weights.index_select(0, at).unsqueeze(-1))
            if y is not None and j == k - 1:
                return y[items].copy_(product) if acc is None else torch.add(acc, product, out=y[items])
            acc = product if acc is None else acc.add_(product)
        return acc

    if y is None:
        return span(slice(None))
    step = max(1, -(-tokens // (4 * torch.get_num_threads())))
    spans = [slice(start, min(start + step, tokens)) for start in range(0, tokens, step)]
    each(span, spans, [(s.stop - s.start) * k * out.shape[-1] for s in spans], device=out.device)
    return y


def scatter_weighted(out: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, items: int) -> torch.Tensor:
    """[items, C'] sum of weights[p] * out[p] over the pairs p of each item (out [P, C'] in pair order)."""
    out = scaled(out, weights.unsqueeze(-1))
    return out.new_zeros(items, out.shape[-1]).index_add_(0, rows, out)

"""The interface every expert step implements (one file per step beside this one; the table in `__init__.py`)."""

from __future__ import annotations

import torch


class ExpertStep:
    """One way to run an `Experts` bank on its routed rows: all steps compute the same function.

    `run` takes the rows sorted by expert (`counts[e]` rows for expert e); rows past sum(counts), the pairs a
    capacity dropped on the sync-free path, give 0. A step whose shapes must stay static handles them itself
    (`static_tail`); for the others the bank runs the segments' rows and pads the rest with 0. `combine` may
    gather the routed pairs' rows and combine their outputs itself (fused around its matmuls); None: the bank
    gathers, runs and scatters."""

    name: str
    static_tail = False  # runs the rows past the segments itself, with no host sync

    def unavailable(self, bank, like: torch.Tensor) -> str | None:
        """Why this step cannot run `bank` on rows like `like` (device, dtype, training mode), or None."""
        return None

    def run(self, bank, x: torch.Tensor, counts: torch.Tensor, groups: torch.Tensor | None,
            tail: bool) -> torch.Tensor:
        """[S, C'] outputs of rows x [S, C] sorted by expert."""
        raise NotImplementedError

    def combine(self, bank, items: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor,
                groups: torch.Tensor | None, position: torch.Tensor | None, tail: bool) -> torch.Tensor | None:
        """[T, C'] the weighted sum of each item's expert outputs, where this step fuses the gather and the
        combine (`Experts.combine`'s arguments); None where it does not."""
        return None


def scaled(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out * weights, in place when autograd does not need `out` and the product keeps its dtype (under autocast
    the experts give bfloat16 and the gate weights are float32): one buffer less to allocate."""
    in_place = not (out.requires_grad or weights.requires_grad) and out.dtype == weights.dtype
    return out.mul_(weights) if in_place else out * weights


def scatter_weighted(out: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, items: int) -> torch.Tensor:
    """[items, C'] sum of weights[p] * out[p] over the pairs p of each item (out [P, C'] in pair order)."""
    out = scaled(out, weights.unsqueeze(-1))
    return out.new_zeros(items, out.shape[-1]).index_add_(0, rows, out)

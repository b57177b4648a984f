"""The triton step: the scattered Triton kernels of `ops/scattered.py` (the gather in fc1's loads, bias, activation
and gate in the epilogues, no host sync). Plain or GLU experts with GELU or SiLU, no inner norm, no clamps, no
dropout while training; on a GPU, or on CPU under TRITON_INTERPRET=1. Forced only: `rule.auto_step` never picks
it."""

from __future__ import annotations

import torch

from ..ops.activations import activation
from ..ops.mode import Mode
from ..ops.pairs import inverse_permutation
from ..ops.scattered import scattered_experts, unavailable
from .base import ExpertStep
from .rows import RoutedRows, Segments


class TritonStep(ExpertStep):
    name = "triton"

    static_shapes = True

    def run(self, bank, x: torch.Tensor, segments: Segments, groups: torch.Tensor | None, mode: Mode) -> torch.Tensor:
        return self._scattered(bank, x, segments, mode)

    def combine(self, bank, items: torch.Tensor, rows: RoutedRows, groups: torch.Tensor | None) -> torch.Tensor | None:
        """With `position` [T, k], on the items themselves: the gather in fc1's loads and the gates in fc2's
        epilogue (None where the bank's rows travel to other ranks, `ExpertBank.step_combines`)."""
        if not bank.step_combines(rows):
            return None
        return self._scattered(bank, items, rows.segments, rows.mode, rows.weights, rows.position)

    @staticmethod
    def _scattered(bank, items: torch.Tensor, segments: Segments, mode: Mode, weights: torch.Tensor | None = None,
                   position: torch.Tensor | None = None) -> torch.Tensor:
        """The triton step (`ops.scattered.scattered_experts`) on rows sorted by expert: items [S, C] -> [S, C'];
        with the pairs' `weights` [P] and `position` [T, k] (`combine`), on the items [T, C] themselves -> [T, C'],
        the gather in fc1's loads and the gates in fc2's epilogue. Dropped rows (past the segments) give 0. Under
        autocast, in autocast's dtype."""
        w1, b1, _, _, w2, b2 = bank.params()
        order = None if position is None else inverse_permutation(position.reshape(-1))  # sorted row -> t * k + j
        return scattered_experts(items, segments.ends(), w1, b1, w2, b2,
                                 act=activation(bank.act), glu=bank.glu, order=order,
                                 top_k=1 if position is None else position.shape[1], gates=weights,
                                 dtype=mode.autocast or w1.dtype)

    def unavailable(self, bank, like: torch.Tensor, mode: Mode) -> str | None:
        """Why the kernels cannot run these experts on `like`'s device, or None."""
        dtype = mode.autocast or bank.weight_dtype
        reasons = [unavailable(like.device, dtype)]
        if activation(bank.act) is None:
            reasons.append(f"the kernels take GELU (exact) or SiLU, not {bank.act}")
        if bank.inner_norm != "none":
            reasons.append(f"the kernels have no inner norm ({bank.inner_norm})")
        if bank.clamped:
            reasons.append("the kernels do not clamp the projections (`clamp`)")
        if bank.training and any(p > 0 for p in bank.drop):
            reasons.append(f"the kernels have no dropout (drop={bank.drop} while training)")
        reasons = [r for r in reasons if r is not None]
        return "; ".join(reasons) if reasons else None

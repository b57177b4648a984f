"""The triton step: the fused Triton kernels of `fused.py` (the gather in fc1's loads, bias, activation and gate
in the epilogues, no host sync). Plain or GLU experts with GELU or SiLU, no inner norm, no clamps, no dropout
while training; on a GPU, or on CPU under TRITON_INTERPRET=1. Forced only: `dispatch.auto_step` never picks it."""

from __future__ import annotations

import torch

from ..dispatch import autocast_dtype
from ..fused import activation, fused_experts, unavailable
from ..routing import inverse_permutation
from ..rows import RoutedRows, Segments
from .base import ExpertStep


class TritonStep(ExpertStep):
    name = "triton"

    static_shapes = True

    def run(self, bank, x: torch.Tensor, segments: Segments, groups: torch.Tensor | None) -> torch.Tensor:
        return self._fused(bank, x, segments)

    def combine(self, bank, items: torch.Tensor, rows: RoutedRows, groups: torch.Tensor | None) -> torch.Tensor | None:
        """With `position` [T, k], on the items themselves: the gather in fc1's loads and the gates in fc2's
        epilogue (None where the bank's rows travel to other ranks, `Experts.fuses_pairs`)."""
        if not bank.fuses_pairs(rows.position):
            return None
        return self._fused(bank, items, rows.segments, rows.weights, rows.position)

    @staticmethod
    def _fused(bank, items: torch.Tensor, segments: Segments, weights: torch.Tensor | None = None,
               position: torch.Tensor | None = None) -> torch.Tensor:
        """The triton step (`fused.fused_experts`) on rows sorted by expert: items [S, C] -> [S, C']; with the
        pairs' `weights` [P] and `position` [T, k] (`combine`), on the items [T, C] themselves -> [T, C'], the
        gather in fc1's loads and the gates in fc2's epilogue. Dropped rows (past the segments) give 0. Under
        autocast, in autocast's dtype."""
        w1, b1, _, _, w2, b2 = bank._param_list()
        order = None if position is None else inverse_permutation(position.reshape(-1))  # sorted row -> t * k + j
        return fused_experts(items, segments.ends(), w1, b1, w2, b2,
                             act=activation(bank.act), glu=bank.glu, order=order,
                             top_k=1 if position is None else position.shape[1], gates=weights,
                             dtype=autocast_dtype(items.device) or w1.dtype)

    def unavailable(self, bank, like: torch.Tensor) -> str | None:
        """Why the kernels cannot run these experts on `like`'s device, or None."""
        dtype = autocast_dtype(like.device) or bank.fc1.weight.dtype
        reasons = [unavailable(like.device, dtype)]
        if activation(bank.act) is None:
            reasons.append(f"the kernels take GELU (exact) or SiLU, not {bank.act}")
        if bank.inner_norm != "none":
            reasons.append(f"the kernels have no inner norm ({bank.inner_norm})")
        if bank.clamp is not None:
            reasons.append("the kernels do not clamp the projections (`clamp`)")
        if bank.training and any(p > 0 for p in bank.drop):
            reasons.append(f"the kernels have no dropout (drop={bank.drop} while training)")
        reasons = [r for r in reasons if r is not None]
        return "; ".join(reasons) if reasons else None

"""Routers: from items [T, C] to a `Routing` (which experts, with which weights).

Routers are plain modules that take numbers, never specs; `build.py` translates a spec's `router:` into
one through the `ROUTERS` registry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Routing:
    """The routing decision of one forward.

    Attributes:
        logits: [T, E] router logits.
        probs: [T, E] softmax of the logits.
        experts: [T, k] chosen expert per item and slot, best first.
        weights: [T, k] the gate value each chosen expert's output is scaled by.
    """

    logits: torch.Tensor
    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.probs.shape[-1]


class TopKRouter(nn.Module):
    """Token choice top-k with a linear gate: g(x) = softmax(W_g x), keep the k largest (Shazeer et al. 2017).

    Args:
        dim: item width C.
        experts: E.
        top_k: k experts per item.
        normalize: renormalize the k kept gate values to sum to 1.
    """

    def __init__(self, dim: int, experts: int, top_k: int, normalize: bool = False):
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        self.gate = nn.Linear(dim, experts, bias=False)
        nn.init.normal_(self.gate.weight, std=0.02)

    @property
    def num_experts(self) -> int:
        return self.gate.out_features

    def macs_per_item(self) -> int:
        """Multiply-adds of the gate for one item."""
        return self.gate.in_features * self.gate.out_features

    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.gate(x)
        probs = logits.float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(logits, probs, experts, weights.to(x.dtype))


ROUTERS: dict[str, type[nn.Module]] = {"topk": TopKRouter}
"""Router kind (the spec's `router.kind`) -> module class."""


def importance_load_loss(routing: Routing) -> torch.Tensor:
    """Shazeer et al. 2017: (CV(importance)^2 + CV(load)^2) / 2.

    Importance_i = sum_x p_i(x); Load_i = number of items with i among their top-k (without router noise
    the load is a count, so only the importance term carries gradient).
    """
    importance = routing.probs.sum(dim=0)
    load = torch.zeros_like(importance).index_add_(
        0, routing.experts.reshape(-1), torch.ones(routing.experts.numel(), device=importance.device)
    )
    return (_cv_squared(importance) + _cv_squared(load)) / 2


def switch_loss(routing: Routing) -> torch.Tensor:
    """Fedus et al. 2021: E * sum_i f_i * P_i, f_i = share of items whose top-1 is i, P_i = mean prob of i."""
    experts = routing.num_experts
    top1 = F.one_hot(routing.experts[:, 0], experts).float()
    return experts * (top1.mean(dim=0) * routing.probs.mean(dim=0)).sum()


def _cv_squared(x: torch.Tensor) -> torch.Tensor:
    """Squared coefficient of variation, std(x)^2 / mean(x)^2 (0 for a single expert)."""
    if x.numel() <= 1:
        return x.new_zeros(())
    return x.var(unbiased=False) / (x.mean() ** 2 + 1e-10)


AUX_LOSSES = {"importance_load": importance_load_loss, "switch": switch_loss}
"""Aux-loss kind (the spec's `aux_loss.kind`) -> function of a Routing."""

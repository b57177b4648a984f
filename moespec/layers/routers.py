"""Gates and routers: from items [T, C] to a `Routing` (which item goes to which expert, with which weight).

Every router returns the same thing: (item, expert) pairs already sorted by expert, so the MoE layer runs
each expert on one contiguous segment and scatters the weighted outputs back. Routers are plain modules
that take numbers, never specs; each router kind of `moespec/routers/` builds its module.

    topk           token choice: each item picks k experts; optional noise, capacity, BPR, importance drop
    image          one decision per image (from its [CLS] or mean token), shared by all its tokens
    expert choice  each expert picks its top C = c * T / E items
(Soft MoE has no discrete routing; it is its own layer in `soft.py`.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class LinearGate(nn.Module):
    """logits = W_g x (no bias)."""

    def __init__(self, dim: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def macs_per_item(self) -> int:
        return self.weight.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ProjectedGate(nn.Module):
    """Cosine or L2 gate (Chi et al. 2022): project x to `proj_dim`, compare with learned expert codes.

    cosine: logits = cos(W_p x, e_i) / temperature;  l2: logits = -||W_p x - e_i|| / temperature.
    """

    def __init__(self, dim: int, experts: int, proj_dim: int = 16, temperature: float = 0.07, metric: str = "cosine"):
        super().__init__()
        self.metric, self.temperature = metric, temperature
        self.proj = nn.Linear(dim, proj_dim, bias=False)
        self.weight = nn.Parameter(torch.empty(experts, proj_dim))  # expert codes
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.normal_(self.weight, std=0.02)

    def macs_per_item(self) -> int:
        return self.proj.weight.numel() + self.weight.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(x)
        if self.metric == "cosine":
            return F.linear(F.normalize(z, dim=-1), F.normalize(self.weight, dim=-1)) / self.temperature
        return -torch.cdist(z.float(), self.weight.float()).to(z.dtype) / self.temperature


@dataclass
class Routing:
    """The routing decision of one forward.

    Attributes:
        probs: [U, E] softmax of the router logits per decision unit (item, or image for image routing).
        logits: [U, E] router logits (before noise).
        item: [P] item index of each (item, expert) pair, pairs grouped by expert in expert order.
        counts: [E] pairs per expert (segment lengths).
        weights: [P] gate value each pair's expert output is scaled by.
        top1: [U] best expert per decision unit; top1_value: [U] its gate probability.
        load: [E] items assigned to each expert before any capacity drop (smooth under router noise).
        kept: [T] whether each item was dispatched to at least one expert.
    """

    probs: torch.Tensor
    logits: torch.Tensor
    item: torch.Tensor
    counts: torch.Tensor
    weights: torch.Tensor
    top1: torch.Tensor
    top1_value: torch.Tensor
    load: torch.Tensor
    kept: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.probs.shape[-1]


def _pairs(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, priority: torch.Tensor | None = None,
           capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the choices `experts` [T, k] (gate values `weights` [T, k]) by expert.

    With a `capacity`, each expert keeps its first `capacity` pairs in fill order: first choices before
    second choices, then by item position, or by `priority` [T] descending (BPR). Returns the item index
    [P] and weight [P] of each kept pair, grouped by expert, and the pairs per expert [E].
    """
    tokens, top_k = experts.shape
    flat = experts.reshape(-1)
    if capacity is None:
        order = torch.argsort(flat, stable=True)
    else:
        rank = torch.arange(tokens, device=flat.device)
        if priority is not None:
            rank = torch.empty_like(rank).index_copy_(0, torch.argsort(priority, descending=True, stable=True), rank)
        slot = torch.arange(top_k, device=flat.device).repeat(tokens)
        order = torch.argsort((flat * top_k + slot) * tokens + rank.repeat_interleave(top_k))
    counts = torch.bincount(flat, minlength=num_experts)
    if capacity is not None:
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(order.numel(), device=flat.device) - starts.repeat_interleave(counts)
        order = order[position < capacity]
        counts = counts.clamp(max=capacity)
    return order // top_k, counts, weights.reshape(-1)[order]


class TopKRouter(nn.Module):
    """Token choice top-k (Shazeer et al. 2017), optionally noisy, capacity-limited, BPR, importance drop.

    Args:
        gate: a gate module mapping items [T, C] to logits [T, E].
        experts: E.  top_k: k.
        normalize: renormalize the k kept gate values to sum to 1.
        noise_std: std of N(0, std^2) added to the logits in training (0: none).
        capacity_factor: each expert keeps at most ceil(c * k * T / E) pairs (None: dropless).
        bpr: fill capacity by each item's top-1 gate value instead of item order (Riquelme et al. 2021).
        drop_fraction: importance-score routing (Sparse-MLP): this fraction of items, those with the lowest
            top-1 gate value, is not dispatched.
    """

    def __init__(self, gate: nn.Module, experts: int, top_k: int, *, normalize: bool = False, noise_std: float = 0.0,
                 capacity_factor: float | None = None, bpr: bool = False, drop_fraction: float = 0.0):
        super().__init__()
        self.gate, self.num_experts, self.top_k = gate, experts, top_k
        self.normalize, self.noise_std = normalize, noise_std
        self.capacity_factor, self.bpr, self.drop_fraction = capacity_factor, bpr, drop_fraction

    def capacity(self, items: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * self.top_k * items / self.num_experts)

    def dispatched(self, items: int) -> int:
        """Items that importance-score routing keeps out of `items`."""
        return items - math.floor(self.drop_fraction * items)

    def gate_macs(self, items: int, images: int) -> int:
        return items * self.gate.macs_per_item()

    def routed_rows(self, items: int, images: int) -> int:
        """Expert rows under perfect balance and no capacity drops: k per dispatched item."""
        return self.top_k * self.dispatched(items)

    def executed_rows(self, items: int) -> int | None:
        """Expert rows when every expert runs its full capacity (None when dropless)."""
        capacity = self.capacity(items)
        return None if capacity is None else self.num_experts * capacity

    def forward(self, x: torch.Tensor, images: int = 1) -> Routing:
        logits = self.gate(x).float()
        noisy = logits
        if self.training and self.noise_std > 0:
            noisy = logits + torch.randn_like(logits) * self.noise_std
        probs = noisy.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        load = _load(logits, noisy, self.top_k, self.noise_std if self.training else 0.0, experts)
        kept = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        if self.drop_fraction > 0:
            dropped = math.floor(self.drop_fraction * x.shape[0])
            kept[torch.argsort(weights[:, 0], stable=True)[:dropped]] = False
        keep_rows = kept.nonzero().squeeze(1)
        item, counts, pair_weights = _pairs(
            experts[keep_rows], weights[keep_rows], self.num_experts,
            priority=weights[keep_rows, 0] if self.bpr else None, capacity=self.capacity(x.shape[0]))
        item = keep_rows[item]
        kept = torch.zeros_like(kept).index_fill_(0, item, True)
        return Routing(probs, logits, item, counts, pair_weights.to(x.dtype), experts[:, 0], weights[:, 0], load, kept)


def _load(logits: torch.Tensor, noisy: torch.Tensor, top_k: int, noise_std: float,
          experts: torch.Tensor) -> torch.Tensor:
    """Load_i = sum over items of P(i is in the item's top-k). Without noise it is a count; with noise it is
    Shazeer's smooth estimate: Phi((clean_i - threshold) / std), the threshold being the k-th largest noisy
    logit among the other experts."""
    if noise_std <= 0 or top_k >= logits.shape[-1]:
        return torch.zeros(logits.shape[-1], device=logits.device).index_add_(
            0, experts.reshape(-1), torch.ones(experts.numel(), device=logits.device))
    top = noisy.topk(top_k + 1, dim=-1).values
    is_in = noisy >= top[:, top_k - 1 : top_k]
    threshold = torch.where(is_in, top[:, top_k : top_k + 1], top[:, top_k - 1 : top_k])
    normal = torch.distributions.Normal(0.0, 1.0)
    return normal.cdf((logits - threshold) / noise_std).sum(dim=0)


class ImageRouter(nn.Module):
    """Image-level routing (ViMoE): the gate reads one vector per image, the [CLS] token (`pool="cls"`,
    the first token of each image's sequence) or the mean token, and picks top-k experts for every token
    of that image.
    """

    def __init__(self, gate: nn.Module, experts: int, top_k: int, *, normalize: bool = False, pool: str = "cls"):
        super().__init__()
        self.gate, self.num_experts, self.top_k = gate, experts, top_k
        self.normalize, self.pool = normalize, pool

    def gate_macs(self, items: int, images: int) -> int:
        return images * self.gate.macs_per_item()  # one decision per image

    def routed_rows(self, items: int, images: int) -> int:
        return self.top_k * items

    def forward(self, x: torch.Tensor, images: int = 1) -> Routing:
        per_image = x.reshape(images, -1, x.shape[-1])
        vectors = per_image[:, 0] if self.pool == "cls" else per_image.mean(dim=1)
        logits = self.gate(vectors).float()
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        tokens = per_image.shape[1]
        token_experts = experts.repeat_interleave(tokens, dim=0)
        item, counts, pair_weights = _pairs(token_experts, weights.repeat_interleave(tokens, dim=0), self.num_experts)
        load = torch.zeros(self.num_experts, device=x.device).index_add_(
            0, experts.reshape(-1), torch.ones(experts.numel(), device=x.device))
        kept = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        return Routing(probs, logits, item, counts, pair_weights.to(x.dtype), experts[:, 0], weights[:, 0], load, kept)


class ExpertChoiceRouter(nn.Module):
    """Expert choice (Zhou et al. 2022): probs = softmax over experts; expert i takes the C items with the
    highest probs[:, i], C = round(c * T / E) (at least 1, at most T). An item may be taken by several
    experts or by none."""

    def __init__(self, gate: nn.Module, experts: int, capacity: float = 1.0):
        super().__init__()
        self.gate, self.num_experts, self.capacity_per_item = gate, experts, capacity
        self.top_k = 1  # for reporting; the average is `capacity` experts per item

    def capacity(self, items: int) -> int:
        return min(items, max(1, round(self.capacity_per_item * items / self.num_experts)))

    def gate_macs(self, items: int, images: int) -> int:
        return items * self.gate.macs_per_item()

    def routed_rows(self, items: int, images: int) -> int:
        """E * C rows: c expert passes per item on average."""
        return self.num_experts * self.capacity(items)

    def forward(self, x: torch.Tensor, images: int = 1) -> Routing:
        logits = self.gate(x).float()
        probs = logits.softmax(dim=-1)
        values, chosen = probs.t().topk(self.capacity(x.shape[0]), dim=-1)  # [E, C]
        item = chosen.reshape(-1)
        counts = torch.full((self.num_experts,), chosen.shape[1], dtype=torch.long, device=x.device)
        kept = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device).index_fill_(0, item, True)
        top1_value, top1 = probs.max(dim=-1)
        return Routing(probs, logits, item, counts, values.reshape(-1).to(x.dtype), top1, top1_value,
                       counts.float(), kept)


AUX_LOSSES: dict[str, Callable[[Routing], torch.Tensor]] = {}
"""Aux-loss kind (the spec's `aux_loss.kind`) -> function of a Routing."""


def register_aux_loss(kind: str) -> Callable[[Callable[[Routing], torch.Tensor]], Callable[[Routing], torch.Tensor]]:
    """Register the decorated function of a Routing as the aux loss `kind`."""

    def wrap(loss: Callable[[Routing], torch.Tensor]) -> Callable[[Routing], torch.Tensor]:
        AUX_LOSSES[kind] = loss
        return loss

    return wrap


@register_aux_loss("importance_load")
def importance_load_loss(routing: Routing) -> torch.Tensor:
    """Shazeer et al. 2017: (CV(importance)^2 + CV(load)^2) / 2, with Importance_i = sum_x p_i(x) and
    Load_i = sum_x P(i in top-k of x) (a count without router noise: only importance carries gradient)."""
    return (_cv_squared(routing.probs.sum(dim=0)) + _cv_squared(routing.load)) / 2


@register_aux_loss("switch")
def switch_loss(routing: Routing) -> torch.Tensor:
    """Fedus et al. 2021: E * sum_i f_i * P_i, f_i = share of units whose top-1 is i, P_i = mean prob of i."""
    experts = routing.num_experts
    top1 = F.one_hot(routing.top1, experts).float()
    return experts * (top1.mean(dim=0) * routing.probs.mean(dim=0)).sum()


@register_aux_loss("z_loss")
def z_loss(routing: Routing) -> torch.Tensor:
    """ST-MoE router z-loss (Zoph et al. 2022): mean over units of logsumexp(logits)^2."""
    return torch.logsumexp(routing.logits, dim=-1).square().mean()


def _cv_squared(x: torch.Tensor) -> torch.Tensor:
    """Squared coefficient of variation, var(x) / mean(x)^2 (population variance; 0 for a single expert)."""
    if x.numel() <= 1:
        return x.new_zeros(())
    return x.var(unbiased=False) / (x.mean() ** 2 + 1e-10)


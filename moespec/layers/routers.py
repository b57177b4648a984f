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

import torch
import torch.nn.functional as F
from torch import nn

from .dispatch import exporting, sync_free
from .interfaces import Router
from .routing import (
    Groups,
    Routing,
    at_least_fp32,
    group_pairs,
    items_per_image,
    kept_first,
    load_counts,
    smooth_load,
)


class LinearGate(nn.Module):
    """logits = W_g x (no bias)."""

    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
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

    def __init__(self, dim: int, num_experts: int, proj_dim: int = 16, temperature: float = 0.07,
                 metric: str = "cosine"):
        super().__init__()
        self.metric, self.temperature = metric, temperature
        self.proj = nn.Linear(dim, proj_dim, bias=False)
        self.weight = nn.Parameter(torch.empty(num_experts, proj_dim))  # expert codes
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


class TopKRouter(Router):
    """Token choice top-k (Shazeer et al. 2017), optionally noisy, capacity-limited, BPR, importance drop.

    Args:
        gate: a gate module mapping items [T, C] to logits [T, E].
        num_experts: E.  top_k: k.
        normalize: renormalize the k kept gate values to sum to 1.
        noise_std: std of N(0, std^2) added to the logits in training (0: none).
        capacity_factor: each expert keeps at most ceil(c * k * T / E) pairs (None: dropless).
        bpr: fill capacity by each item's top-1 gate value instead of item order (Riquelme et al. 2021).
        drop_fraction: importance-score routing (Sparse-MLP): this fraction of items, those with the lowest
            top-1 gate value, is not dispatched.
        group: images per routing group (1: each image alone; None: the whole batch). Capacity, BPR order and
            drops are decided within each group, T above being the group's items.
    """

    def __init__(self, gate: nn.Module, num_experts: int, top_k: int, *, normalize: bool = False,
                 noise_std: float = 0.0, capacity_factor: float | None = None, bpr: bool = False,
                 drop_fraction: float = 0.0, group: int | None = 1):
        super().__init__()
        self.gate, self.num_experts, self.top_k = gate, num_experts, top_k
        self.normalize, self.noise_std = normalize, noise_std
        self.capacity_factor, self.bpr, self.drop_fraction = capacity_factor, bpr, drop_fraction
        self.group = group

    def capacity(self, items: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * self.top_k * items / self.num_experts)

    def dispatched(self, items: int) -> int:
        """Items that importance-score routing keeps out of `items`."""
        return items - math.floor(self.drop_fraction * items)

    def gate_macs(self, items: int, images: int) -> int:
        return items * self.gate.macs_per_item()

    def experts_per_item(self, items: int, images: int) -> int:
        return self.top_k

    def capacity_rows(self, items: int) -> float | None:
        """Expert rows per `items` (one image's) when every expert runs its full capacity in full routing
        groups (None when dropless): E * capacity(T_group) / images per group."""
        if self.capacity_factor is None:
            return None
        images = self.group or 1  # `batch` is costed at the stats' batch, one image
        return self.num_experts * self.capacity(items * images) / images

    def route(self, x: torch.Tensor, images: int = 1) -> Routing:
        logits = at_least_fp32(self.gate(x))
        noisy = logits
        if self.training and self.noise_std > 0:
            noisy = logits + torch.randn_like(logits) * self.noise_std
        probs = noisy.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        load = smooth_load(logits, noisy, self.top_k, self.noise_std if self.training else 0.0, experts)
        groups = Groups.of(x.shape[0], images, self.group, self.training)
        dispatched = None
        if self.drop_fraction > 0:  # the lowest top-1 gates of each group
            dropped = groups.per_group([math.floor(self.drop_fraction * n) for n in groups.sizes()], x.device)
            rank = groups.rank(weights[:, 0], x.device)
            dispatched = rank >= dropped[groups.of_item(x.device)]
        capacity = None if self.capacity_factor is None else [self.capacity(n) for n in groups.sizes()]
        pairs = group_pairs(experts, weights, self.num_experts, priority=weights[:, 0] if self.bpr else None,
                            capacity=capacity, groups=groups, dispatched=dispatched)
        return Routing(probs, logits, pairs.item, pairs.counts, pairs.weights.to(x.dtype), experts[:, 0], weights[:, 0],
                       load, pairs.kept, pairs.expert, tail=pairs.tail, position=pairs.position)


    def extra_repr(self) -> str:
        extras = [("normalize=True", self.normalize), (f"noise_std={self.noise_std:g}", self.noise_std > 0),
                  (f"capacity_factor={self.capacity_factor}", self.capacity_factor is not None),
                  ("bpr=True", self.bpr), (f"drop_fraction={self.drop_fraction:g}", self.drop_fraction > 0),
                  (f"group={self.group}", self.capacity_factor is not None or self.drop_fraction > 0)]
        return ", ".join([f"experts={self.num_experts}, top_k={self.top_k}"] + [text for text, on in extras if on])


class ImageRouter(Router):
    """Image-level routing (ViMoE): the gate reads one vector per image, the [CLS] token (`pool="cls"`,
    the first token of each image's sequence) or the mean token, and picks top-k experts for every token
    of that image.
    """

    def __init__(self, gate: nn.Module, num_experts: int, top_k: int, *, normalize: bool = False, pool: str = "cls"):
        super().__init__()
        self.gate, self.num_experts, self.top_k = gate, num_experts, top_k
        self.normalize, self.pool = normalize, pool

    def gate_macs(self, items: int, images: int) -> int:
        return images * self.gate.macs_per_item()  # one decision per image

    def experts_per_item(self, items: int, images: int) -> int:
        return self.top_k  # every token goes where its image goes

    def route(self, x: torch.Tensor, images: int = 1) -> Routing:
        per_image = x.reshape(images, items_per_image(x.shape[0], images), x.shape[-1])
        vectors = per_image[:, 0] if self.pool == "cls" else per_image.mean(dim=1)
        logits = at_least_fp32(self.gate(vectors))
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        tokens = per_image.shape[1]
        token_experts = experts.repeat_interleave(tokens, dim=0)
        pairs = group_pairs(token_experts, weights.repeat_interleave(tokens, dim=0), self.num_experts)
        return Routing(probs, logits, pairs.item, pairs.counts, pairs.weights.to(x.dtype), experts[:, 0], weights[:, 0],
                       load_counts(experts, self.num_experts), pairs.kept, pairs.expert, position=pairs.position)


    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, normalize={self.normalize}, pool={self.pool}"


class ExpertChoiceRouter(Router):
    """Expert choice (Zhou et al. 2022): probs = softmax over experts; expert i takes the C items with the
    highest probs[:, i], C = round(c * T / E) (at least 1, at most T), within each routing group of `group`
    images (1: each image alone; None: the whole batch), T being the group's items. An item may be taken by
    several experts or by none."""

    def __init__(self, gate: nn.Module, num_experts: int, capacity: float = 1.0, group: int | None = 1):
        super().__init__()
        self.gate, self.num_experts, self.capacity_per_item = gate, num_experts, capacity
        self.group = group

    def capacity(self, items: int) -> int:
        if isinstance(items, torch.Tensor):  # a TorchScript trace (fvcore's) gives sizes as 0-d tensors
            items = int(items)
        return min(items, max(1, round(self.capacity_per_item * items / self.num_experts)))

    def gate_macs(self, items: int, images: int) -> int:
        return items * self.gate.macs_per_item()

    def experts_per_item(self, items: int, images: int) -> float:
        """E * C rows for T items: about c expert passes per item."""
        return self.num_experts * self.capacity(items) / items if items else self.capacity_per_item

    def route(self, x: torch.Tensor, images: int = 1) -> Routing:
        logits = at_least_fp32(self.gate(x))
        probs = logits.softmax(dim=-1)
        groups = Groups.of(x.shape[0], images, self.group, self.training)
        experts, size, count = self.num_experts, groups.items, groups.count
        capacity = [self.capacity(n) for n in groups.sizes()]  # the last group may be shorter (eval)
        padded = F.pad(probs, (0, 0, 0, count * size - x.shape[0]), value=-1.0)  # a padding row is never chosen
        values, chosen = padded.reshape(count, size, experts).transpose(1, 2).topk(capacity[0], dim=-1)  # [G, E, C]
        item = (chosen + torch.arange(count, device=x.device).view(-1, 1, 1) * size).transpose(0, 1)  # [E, G, C]
        values, expert = values.transpose(0, 1), torch.arange(experts, device=x.device).view(-1, 1, 1)
        expert = expert.expand_as(item)
        item, values, expert = item.reshape(-1), values.reshape(-1), expert.reshape(-1)
        counts = torch.full((experts,), sum(capacity), dtype=torch.long, device=x.device)
        tail = False
        if capacity[-1] < capacity[0]:  # keep only the last group's own C choices
            keep = torch.arange(capacity[0], device=x.device) < groups.per_group(capacity, x.device).view(-1, 1)
            keep = keep.expand(experts, count, capacity[0]).reshape(-1)
            if exporting():
                values, item = values * keep, item.clamp(max=x.shape[0] - 1)
            elif sync_free(x.device):  # the choices left out after the segments, with weight 0 (`Routing.tail`)
                last = kept_first(keep)
                item, values, expert = item[last].clamp(max=x.shape[0] - 1), (values * keep)[last], expert[last]
                keep, tail = keep[last], True
            else:
                item, values, expert = item[keep], values[keep], expert[keep]
        kept = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        kept = kept.index_put_((item,), keep, accumulate=True) if tail else kept.index_fill_(0, item, 1)
        top1_value, top1 = probs.max(dim=-1)
        return Routing(probs, logits, item, counts, values.to(x.dtype), top1, top1_value,
                       counts.float(), kept, expert, tail=tail)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, capacity={self.capacity_per_item:g}, group={self.group}"

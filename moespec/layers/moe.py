"""The MoE layer that replaces a dense FFN call site.

    items = x as rows [T, C]  (tokens of [B, N, C], or positions of a [B, H, W, C] / [B, C, H, W] map)
    routing = router(items)                      -> k experts and gate weights per item
    sort (item, expert) pairs by expert          -> one contiguous segment per expert
    y = sum_k weight * expert(item)              -> weighted scatter back (index_add)
    y += shared experts(items)                   -> always-active experts, if any

Dropless by default; with a capacity factor each expert keeps its first ceil(c * k * T / E) items in item
order and a dropped item's MoE output is 0 (its residual carries it).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .experts import Experts
from .routers import AUX_LOSSES, Routing


class MoE(nn.Module):
    """Sparse mixture of experts over the items of a token sequence or feature map.

    Args:
        router: a router module (see `routers.ROUTERS`), returning a `Routing`.
        experts: the routed `Experts` bank.
        shared: an `Experts` bank of always-active experts, or None.
        channels_dim: where the features are: -1 for [..., C] inputs, 1 for [B, C, H, W].
        capacity_factor: None for dropless routing.
        aux_loss_weights: aux-loss kind -> weight, summed by `moespec.aux_loss(model)`.
    """

    def __init__(
        self,
        router: nn.Module,
        experts: Experts,
        shared: Experts | None = None,
        *,
        channels_dim: int = -1,
        capacity_factor: float | None = None,
        aux_loss_weights: dict[str, float] | None = None,
    ):
        super().__init__()
        self.router, self.experts, self.shared = router, experts, shared
        self.channels_dim = channels_dim
        self.capacity_factor = capacity_factor
        self.aux_loss_weights = dict(aux_loss_weights or {})
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.last_routing: Routing | None = None
        self.last_items = 0

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k

    def capacity(self, items: int) -> int | None:
        """Most items one expert takes from a forward of `items` items (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * self.top_k * items / self.num_experts)

    def macs_per_item(self) -> int:
        """Activated MACs per routed item under perfect balance and no drops: the router, k routed experts,
        the shared experts, and the weighted combine (k multiply-adds per output feature)."""
        shared = self.shared.num_experts * self.shared.macs_per_item() if self.shared is not None else 0
        combine = self.top_k * self.experts.out_features
        return self.router.macs_per_item() + self.top_k * self.experts.macs_per_item() + shared + combine

    def executed_macs(self, items: int) -> int | None:
        """MACs the layer executes for `items` items with capacity padding (None when dropless): every
        expert runs its full capacity, and the combine covers every executed row."""
        capacity = self.capacity(items)
        if capacity is None:
            return None
        rows = self.num_experts * capacity
        shared = self.shared.num_experts * self.shared.macs_per_item() if self.shared is not None else 0
        routed = rows * (self.experts.macs_per_item() + self.experts.out_features)
        return items * (self.router.macs_per_item() + shared) + routed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels_last = x if self.channels_dim in (-1, x.dim() - 1) else x.movedim(self.channels_dim, -1)
        items = channels_last.reshape(-1, channels_last.shape[-1])
        groups = None  # image index per item, only for experts that normalize per image
        if self.experts.needs_groups or (self.shared is not None and self.shared.needs_groups):
            groups = torch.arange(x.shape[0], device=x.device).repeat_interleave(items.shape[0] // x.shape[0])
        routing = self.router(items)
        y = self._dispatch(items, routing, groups)
        if self.shared is not None:
            y = y + self.shared.forward_all(items, groups)
        self.last_routing, self.last_items = routing, items.shape[0]
        self.aux_losses = {kind: fn(routing) for kind, fn in AUX_LOSSES.items()}
        y = y.reshape(*channels_last.shape[:-1], y.shape[-1])
        return y if channels_last is x else y.movedim(-1, self.channels_dim)

    def _dispatch(self, items: torch.Tensor, routing: Routing, groups: torch.Tensor | None) -> torch.Tensor:
        """Sort (item, slot) pairs by expert, run each expert on its segment, scatter back weighted."""
        top_k = routing.experts.shape[1]
        flat_experts = routing.experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts)
        capacity = self.capacity(items.shape[0])
        if capacity is not None:
            # rank of each pair within its expert's segment; keep the first `capacity` (item order)
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(order.numel(), device=items.device) - starts.repeat_interleave(counts)
            order = order[rank < capacity]
            counts = counts.clamp(max=capacity)
        item_of = order // top_k
        outputs = self.experts(items[item_of], counts.tolist(), groups[item_of] if groups is not None else None)
        outputs = outputs * routing.weights.reshape(-1, 1)[order]
        return items.new_zeros(items.shape[0], outputs.shape[-1]).index_add_(0, item_of, outputs)

    def weighted_aux_loss(self) -> torch.Tensor | None:
        """Sum of weight * aux loss of the last forward (None before the first forward)."""
        if not self.aux_losses or not self.aux_loss_weights:
            return None
        return sum(weight * self.aux_losses[kind] for kind, weight in self.aux_loss_weights.items())

    def extra_repr(self) -> str:
        capacity = "dropless" if self.capacity_factor is None else f"capacity_factor={self.capacity_factor}"
        return f"experts={self.num_experts}, top_k={self.top_k}, channels_dim={self.channels_dim}, {capacity}"


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The load-balancing loss of the last forward: sum over MoE layers of weight * loss (0 if none ran).

    Add it to the task loss: `loss = task_loss + moespec.aux_loss(model)`.
    """
    losses = [loss for m in model.modules() if isinstance(m, MoE) and (loss := m.weighted_aux_loss()) is not None]
    if not losses:
        return torch.zeros(())
    return torch.stack(losses).sum()

"""The sparse MoE layer that replaces a dense FFN call site.

    items = x as rows [T, C]  (tokens of [B, N, C], or positions of a [B, H, W, C] / [B, C, H, W] map)
    routing = router(items)       -> (item, expert) pairs grouped by expert, with gate weights
    experts(items[pairs])         -> one contiguous segment per expert
    y = index_add(weight * out)   -> weighted scatter back; an item no expert took gets 0 (its residual
                                     carries it)
    y += shared experts(items)    -> always-active experts, if any
    AuxLossAutoScaler(y, aux)     -> with aux_loss_in_backward: the aux loss's gradient rides on y's backward

The router decides everything about who goes where (top-k, capacity, BPR, drops, expert choice, image
level); this layer only moves rows. `SoftMoE` (soft.py) is the one layer with its own dispatch.
"""

from __future__ import annotations

import torch
from torch import nn

from .experts import Experts
from .routers import AUX_LOSSES, Routing


class MoE(nn.Module):
    """Sparse mixture of experts over the items of a token sequence or feature map.

    Args:
        router: a router module (`routers.py`), called as router(items [T, C], images) -> Routing.
        experts: the routed `Experts` bank.
        shared: an `Experts` bank of always-active experts, or None.
        channels_dim: where the features are: -1 for [..., C] inputs, 1 for [B, C, H, W].
        aux_loss_weights: aux-loss kind -> weight, summed by `moespec.aux_loss(model)`.
        aux_loss_in_backward: attach the weighted aux loss to the output with `AuxLossAutoScaler`, so that its
            gradient (times `aux_loss_backward_scale`) reaches the router in backward without `moespec.aux_loss`.
    """

    def __init__(self, router: nn.Module, experts: Experts, shared: Experts | None = None, *, channels_dim: int = -1,
                 aux_loss_weights: dict[str, float] | None = None, aux_loss_in_backward: bool = False):
        super().__init__()
        self.router, self.experts, self.shared = router, experts, shared
        self.channels_dim = channels_dim
        self.aux_loss_weights = dict(aux_loss_weights or {})
        self.aux_loss_in_backward = aux_loss_in_backward
        self.aux_loss_backward_scale = 1.0  # e.g. 1 / accumulation steps, or the AMP grad scaler's scale
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.last_routing: Routing | None = None
        self.last_items = self.last_images = 0

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels_last = x if self.channels_dim in (-1, x.dim() - 1) else x.movedim(self.channels_dim, -1)
        items = channels_last.reshape(-1, channels_last.shape[-1])
        images = x.shape[0]
        groups = None  # image index per item, only for experts that normalize per image
        if self.experts.needs_groups or (self.shared is not None and self.shared.needs_groups):
            groups = torch.arange(images, device=x.device).repeat_interleave(items.shape[0] // images)
        routing = self.router(items, images)
        rows = routing.item
        out = self.experts(items[rows], routing.counts, groups[rows] if groups is not None else None)
        y = items.new_zeros(items.shape[0], out.shape[-1]).index_add_(0, rows, out * routing.weights.unsqueeze(-1))
        if self.shared is not None:
            y = y + self.shared.forward_all(items, groups)
        self.last_routing, self.last_items, self.last_images = routing, items.shape[0], images
        self.aux_losses = {kind: fn(routing) for kind, fn in AUX_LOSSES.items()}
        if self.aux_loss_in_backward and (loss := self.weighted_aux_loss()) is not None and loss.requires_grad:
            y = AuxLossAutoScaler.apply(y, loss, self.aux_loss_backward_scale)
        y = y.reshape(*channels_last.shape[:-1], y.shape[-1])
        return y if channels_last is x else y.movedim(-1, self.channels_dim)

    def router_weights(self) -> list[nn.Parameter]:
        """The weights that decide the routing (the gate's), which upcycling initializes afresh."""
        return list(self.router.parameters())

    def routing_stats(self) -> dict[str, object] | None:
        """Routing of the last forward: items per expert, share of items no expert took, mean top-1 gate."""
        routing = self.last_routing
        if routing is None:
            return None
        return {
            "tokens_per_expert": routing.counts.tolist(),
            "drop_fraction": 1.0 - routing.kept.float().mean().item(),
            "mean_top1_gate": routing.top1_value.float().mean().item(),
        }

    def activated_macs(self, items: int, images: int) -> int:
        """MACs of one forward of `items` items in `images` images, under perfect balance and no drops: the
        gate, each routed row through its expert plus the weighted combine, and the shared experts."""
        per_row = self.experts.macs_per_item() + self.experts.out_features
        return self.router.gate_macs(items, images) + self.router.routed_rows(items, images) * per_row \
            + items * self._shared_macs()

    def executed_macs(self, items: int, images: int) -> int | None:
        """MACs with every expert padded to its capacity (None without a capacity factor)."""
        rows = getattr(self.router, "executed_rows", lambda items: None)(items)
        if rows is None:
            return None
        per_row = self.experts.macs_per_item() + self.experts.out_features
        return self.router.gate_macs(items, images) + rows * per_row + items * self._shared_macs()

    def _shared_macs(self) -> int:
        return self.shared.num_experts * self.shared.macs_per_item() if self.shared is not None else 0

    def weighted_aux_loss(self) -> torch.Tensor | None:
        """Sum of weight * aux loss of the last forward (None before the first forward or without weights)."""
        if not self.aux_losses or not self.aux_loss_weights:
            return None
        return sum(weight * self.aux_losses[kind] for kind, weight in self.aux_loss_weights.items())

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, channels_dim={self.channels_dim}"


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on a layer's output that also sends a gradient into its aux loss in backward (Megatron-LM's
    `MoEAuxLossAutoScaler`): backward returns the output's gradient unchanged and `scale` as the gradient of
    `aux_loss`, exactly as if `scale * aux_loss` had been added to the loss being differentiated."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The load-balancing loss of the last forward: sum over MoE layers of weight * loss (0 if none ran).

    Add it to the task loss: `loss = task_loss + moespec.aux_loss(model)`. Layers built with
    `aux_loss_in_backward` already send their loss's gradient in backward; their part is returned detached
    (for logging), so adding it as well does not count it twice.
    """
    losses = [loss.detach() if m.aux_loss_in_backward else loss for m in model.modules()
              if isinstance(m, MoE) and (loss := m.weighted_aux_loss()) is not None]
    if not losses:
        return torch.zeros(())
    return torch.stack(losses).sum()

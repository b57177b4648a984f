"""Soft MoE (Puigcerver et al. 2024, "From Sparse to Soft Mixtures of Experts").

For each sequence X [N, C] of one image, with n experts of p slots each (S = n * p slots):

    logits = l2norm(X) @ (scale * l2norm(Phi))      [N, S]   Phi: [C, S], normalized over C
    D = softmax over tokens (dim 0)                 each slot is a convex combination of all tokens
    C = softmax over slots (dim 1)                  each output token is a convex combination of all slots
    X~ = D^T X                                      [S, C]   slot inputs; expert i takes slots i*p .. i*p+p-1
    Y = C Y~                                        [N, C']  Y~ = the experts' slot outputs

No token is dropped, there is no load-balancing loss, and the cost follows the number of slots, not experts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import all_reduce_sum
from .dispatch import exporting
from .experts import Experts
from .interfaces import MoELayer


class SoftMoE(MoELayer):
    """Soft MoE over the items of each image.

    Args:
        experts: the `Experts` bank (n experts).
        slots_per_expert: p.
        shared: always-active experts added to the output, or None.
        channels_dim: -1 for [..., C] inputs, 1 for [B, C, H, W].
    """

    def __init__(self, experts: Experts, slots_per_expert: int = 1, shared: Experts | None = None, *,
                 channels_dim: int = -1):
        super().__init__()
        self.experts, self.shared, self.channels_dim = experts, shared, channels_dim
        self.slots_per_expert = slots_per_expert
        slots = experts.num_experts * slots_per_expert
        self.phi = nn.Parameter(torch.empty(experts.in_features, slots))
        self.scale = nn.Parameter(torch.empty(()))
        self.reset_parameters()
        self.aux_losses: dict[str, torch.Tensor] = {}  # Soft MoE needs no load balancing
        self.last_dispatch: torch.Tensor | None = None  # [B, N, S] of the last forward
        self.last_combine: torch.Tensor | None = None  # [B, N, S]: how much of each token's output each slot gives
        self.last_items = self.last_images = 0

    def __getstate__(self) -> dict:
        """A copy or pickle is of the layer, not of its last forward (see `MoE.__getstate__`)."""
        return {**self.__dict__, "last_dispatch": None, "last_combine": None, "last_items": 0, "last_images": 0}

    def reset_parameters(self) -> None:
        """phi and the scale only; the expert banks reset themselves."""
        nn.init.normal_(self.phi, std=self.experts.in_features ** -0.5)  # LeCun normal, as in the paper
        nn.init.ones_(self.scale)

    @property
    def slots(self) -> int:
        return self.phi.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.run_pre(x)
        channels_last = x if self.channels_dim in (-1, x.dim() - 1) else x.movedim(self.channels_dim, -1)
        images, dim = x.shape[0], channels_last.shape[-1]
        tokens = channels_last.reshape(images, math.prod(channels_last.shape[1:-1]), dim)  # [B, N, C], B may be 0
        dispatch, combine = self.weights(tokens)
        slot_inputs = torch.einsum("bns,bnc->bsc", dispatch, tokens)  # [B, S, C]
        experts, p = self.num_experts, self.slots_per_expert
        rows = slot_inputs.reshape(images, experts, p, dim).transpose(0, 1).reshape(experts, images * p, dim)
        if self.experts.needs_groups:  # GRN normalizes over each image's slots of an expert
            groups = torch.arange(images, device=x.device).repeat_interleave(p).repeat(experts)
            counts = torch.full((experts,), images * p, device=x.device)
            out = self.experts(rows.reshape(-1, dim), counts, groups)
        else:
            out = self.experts.batched(rows)  # every expert has the same number of slots: nothing to pad
        width = out.shape[-1]
        slot_outputs = out.reshape(experts, images, p, width).transpose(0, 1).reshape(images, self.slots, width)
        y = torch.einsum("bns,bsc->bnc", combine, slot_outputs)
        if self.shared is not None:
            y = y + self.shared.forward_all(tokens.reshape(-1, dim)).reshape(images, tokens.shape[1], y.shape[-1])
        if not exporting():  # an exported graph is a pure function: no routing state
            self.last_dispatch, self.last_combine = dispatch, combine
            self.last_items, self.last_images = images * tokens.shape[1], images
        y = y.reshape(*channels_last.shape[:-1], y.shape[-1])
        return y if channels_last is x else y.movedim(-1, self.channels_dim)

    def weights(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dispatch (softmax over tokens) and combine (softmax over slots) weights, both [B, N, S]."""
        logits = torch.einsum("bnc,cs->bns", F.normalize(tokens, dim=-1), self.scale * F.normalize(self.phi, dim=0))
        return logits.softmax(dim=1), logits.softmax(dim=2)

    def router_weights(self) -> list[nn.Parameter]:
        """The weights that decide the routing, which upcycling initializes afresh: phi (the scale stays 1)."""
        return [self.phi]

    def routing_stats(self) -> dict[str, object] | None:
        """Slots per expert (every token reaches every slot), no drops, and the mean largest dispatch weight."""
        if self.last_dispatch is None:
            return None
        top1 = self.last_dispatch.max(dim=1).values.detach().double()
        group = getattr(self.experts, "routing_group", None)  # expert parallel: every rank's batch
        images, gate, units = all_reduce_sum([top1.new_tensor(self.last_images), top1.sum(),
                                              top1.new_tensor(top1.numel())], group)
        return {
            "tokens_per_expert": [int(images) * self.slots_per_expert] * self.num_experts,
            "drop_fraction": 0.0,
            "mean_top1_gate": (gate / units).item(),
        }

    def experts_per_item(self, items: int, images: int) -> int:
        """Every expert: each slot mixes every token of the sequence."""
        return self.num_experts

    def activated_macs(self, items: int, images: int) -> int:
        """Logits (T x C x S), dispatch D^T X and combine C Y~ (T x S x C each), and the S slot FFNs of each
        image; shared experts on every token. l2-normalization and softmax are elementwise (not counted)."""
        dim, out = self.experts.in_features, self.experts.out_features
        slot_ffns = images * self.slots * self.experts.macs_per_item()
        return items * self.slots * (2 * dim + out) + slot_ffns + items * self.shared_macs()

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, slots_per_expert={self.slots_per_expert}, channels_dim={self.channels_dim}"

"""Soft MoE (Puigcerver et al. 2024, "From Sparse to Soft Mixtures of Experts").

For each sequence X [N, C] of one image, with n experts of p slots each (S = n * p slots):

    logits = l2norm(X) @ (scale * l2norm(Phi))      [N, S]   Phi: [C, S], normalized over C
    D = softmax over tokens (dim 0)                 each slot is a convex combination of all tokens
    C = softmax over slots (dim 1)                  each output token is a convex combination of all slots
    X~ = D^T X                                      [S, C]   slot inputs; expert i takes slots i*p .. i*p+p-1
    Y = C Y~                                        [N, C']  Y~ = the experts' slot outputs

No token is dropped, there is no load-balancing loss, and the cost follows the number of slots, not experts.

The routing ablations of the paper (Puigcerver et al. 2024, Table 2) replace D or C by fixed weights (the
spec's `dispatch` / `combine`, whose learned weights it calls soft):

    dispatch  learned   D = softmax over tokens of the logits
              uniform   D = 1 / N: every slot is the mean of all tokens
              identity  D = I: slot i is token i (needs S = N)
    combine   learned   C = softmax over slots of the logits
              uniform   C = 1 / S: every output token is the mean of all slot outputs
              identity  C = I: token i's output is slot i's (needs S = N)

Identity routing is the paper's "Identity" row (dispatch and combine identity); "Uniform" is uniform / uniform,
"Soft-Uniform" learned dispatch with uniform combine, "Uniform-Soft" the reverse. Without a learned side the
layer has no phi and no scale: nothing is learned about routing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .experts import Experts
from .interfaces import MoELayer
from .ops.collectives import all_reduce_sum
from .ops.mode import Mode, layer_call


class SoftMoE(MoELayer):
    """Soft MoE over the items of each image.

    Args:
        experts: the `Experts` bank (n experts).
        slots_per_expert: p.
        shared: always-active experts added to the output, or None.
        channels_dim: -1 for [..., C] inputs, 1 for [B, C, H, W].
        dispatch: `learned`, `uniform` or `identity` dispatch weights D (module docstring).
        combine: `learned`, `uniform` or `identity` combine weights C.
    """

    def __init__(self, experts: Experts, slots_per_expert: int = 1, shared: Experts | None = None, *,
                 channels_dim: int = -1, dispatch: str = "learned", combine: str = "learned"):
        super().__init__()
        self.experts, self.shared, self.channels_dim = experts, shared, channels_dim
        self.slots_per_expert, self.dispatch, self.combine = slots_per_expert, dispatch, combine
        self.phi = self.scale = None
        if "learned" in (dispatch, combine):  # the logits
            self.phi = nn.Parameter(torch.empty(experts.in_features, self.slots))
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
        if self.phi is not None:
            nn.init.normal_(self.phi, std=self.experts.in_features ** -0.5)  # LeCun normal, as in the paper
            nn.init.ones_(self.scale)

    @property
    def slots(self) -> int:
        return self.experts.num_experts * self.slots_per_expert

    @layer_call(fixes_routing=False)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.run_pre(x)
        mode = Mode.of(x, self.experts, self.phi, self.scale)  # how this call runs, decided once
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
            out = self.experts(rows.reshape(-1, dim), counts, groups, mode=mode)
        else:
            out = self.experts.batched(rows, mode)  # every expert has the same number of slots: nothing to pad
        width = out.shape[-1]
        slot_outputs = out.reshape(experts, images, p, width).transpose(0, 1).reshape(images, self.slots, width)
        y = torch.einsum("bns,bsc->bnc", combine, slot_outputs)
        if self.shared is not None:
            y = y + self.shared.forward_all(tokens.reshape(-1, dim)).reshape(images, tokens.shape[1], y.shape[-1])
        if not mode.exporting:  # an exported graph is a pure function: no routing state
            self.last_dispatch, self.last_combine = dispatch, combine
            self.last_items, self.last_images = images * tokens.shape[1], images
        y = y.reshape(*channels_last.shape[:-1], y.shape[-1])
        return y if channels_last is x else y.movedim(-1, self.channels_dim)

    def weights(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dispatch and combine weights, both [B, N, S]: softmax of the logits over tokens and over slots (learned),
        or the fixed weights of a `uniform` or `identity` side."""
        images, count, slots = tokens.shape[0], tokens.shape[1], self.slots
        if "identity" in (self.dispatch, self.combine) and count != slots:
            raise ValueError(f"identity routing sends token i to slot i, so it needs as many slots as tokens: "
                                 f"{count} tokens per image, but {self.num_experts} experts x "
                                 f"{self.slots_per_expert} slots_per_expert = {slots} slots; make experts x "
                                 f"slots_per_expert = {count}")
        logits = None
        if self.phi is not None:
            logits = torch.einsum("bnc,cs->bns", F.normalize(tokens, dim=-1),
                                  self.scale * F.normalize(self.phi, dim=0))

        def fixed(kind: str, learned: int) -> torch.Tensor:
            if kind == "learned":
                return logits.softmax(dim=learned)
            if kind == "uniform":  # 1 / N over tokens (dispatch), 1 / S over slots (combine)
                return tokens.new_full((images, count, slots), 1.0 / (count if learned == 1 else slots))
            return torch.eye(count, slots, dtype=tokens.dtype, device=tokens.device).expand(images, count, slots)

        return fixed(self.dispatch, 1), fixed(self.combine, 2)

    def router_weights(self) -> list[nn.Parameter]:
        """The weights that decide the routing, which upcycling initializes afresh: phi (the scale stays 1), none
        without a learned side."""
        return [] if self.phi is None else [self.phi]

    def routing_stats(self) -> dict[str, object] | None:
        """Slots per expert (every token reaches every slot), no drops, and the mean largest dispatch weight."""
        if self.last_dispatch is None:
            return None
        top1 = self.last_dispatch.max(dim=1).values.detach().double()
        group = self.experts.transport.stats  # data or expert parallel: every rank's batch
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
        """Logits (T x C x S, where a side is learned), dispatch D^T X and combine C Y~ (T x S x C each: the layer
        multiplies by fixed weights too), and the S slot FFNs of each image; shared experts on every token.
        l2-normalization and softmax are elementwise (not counted)."""
        dim, out = self.experts.in_features, self.experts.out_features
        slot_ffns = images * self.slots * self.experts.macs_per_item()
        logits = dim if self.phi is not None else 0
        return items * self.slots * (logits + dim + out) + slot_ffns + items * self.shared_macs()

    def extra_repr(self) -> str:
        routing = "" if (self.dispatch, self.combine) == ("learned", "learned") else \
            f", dispatch={self.dispatch}, combine={self.combine}"
        return (f"experts={self.num_experts}, slots_per_expert={self.slots_per_expert}, "
                f"channels_dim={self.channels_dim}{routing}")

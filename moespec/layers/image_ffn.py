"""Image-level MoE over whole FFNs: for FFN families that mix positions (PVT-v2's depthwise conv between fc1
and fc2, EfficientFormer-V2's `mid` conv, gMLP's spatial gating unit), which no per-position expert can run.
Under image-level routing every position of an image goes to the same experts, so each expert can be a whole
copy of the dense FFN, run on the images routed to it:

    vectors = router.gate_input(x)         one per image ([CLS] or mean), [B, C]
    routing = router.route(vectors)        (image, expert) pairs, grouped by expert, with gate weights
    y[b] = sum over b's pairs  w * copies[e](x[b], *args)      (+ the shared copies on every image)

Extra arguments of the FFN's call (PVT-v2's `feat_size`) are passed to every copy.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .interfaces import Router
from .moe import BACKWARD_SCALE_CHECK, AuxLossAutoScaler, MoE
from .ops.mode import Mode, layer_call
from .routing import AUX_LOSSES, Routing


class FFNCopies(nn.Module):
    """`num_experts` copies of one dense FFN module (`copies.{i}` holds the dense FFN's own names)."""

    def __init__(self, ffn: nn.Module, num_experts: int):
        super().__init__()
        self.copies = nn.ModuleList(copy.deepcopy(ffn) for _ in range(num_experts))
        self.num_experts = num_experts
        self.needs_groups = False

    def forward_all(self, x: torch.Tensor, *args) -> torch.Tensor:
        """The sum of every copy's output on x (shared experts)."""
        return sum(ffn(x, *args) for ffn in self.copies)


class ImageFFNMoE(MoE):
    """MoE whose experts are whole FFNs, routed per image (see the module docstring).

    Args:
        router: an image-level router (`ImageRouter`): `gate_input` gives one vector per image, and `route` on
            those vectors gives (image, expert) pairs.
        experts / shared: `FFNCopies` of the dense FFN (shared: always active, or None).
        out_features: the FFN's output channels (the weighted combine's MACs per position).
        ffn_macs: MACs of one copy on one image, which counting reads from the dense model's trace (fvcore, the
            dense FFN's own figure); None until set.
    """

    def __init__(self, router: Router, experts: FFNCopies, shared: FFNCopies | None = None, *, out_features: int,
                 channels_dim: int = -1, aux_loss_weights: dict[str, float] | None = None,
                 aux_loss_in_backward: bool = False, aux_loss_backward_scale: float = 1.0):
        super().__init__(router, experts, shared, channels_dim=channels_dim, aux_loss_weights=aux_loss_weights,
                         aux_loss_in_backward=aux_loss_in_backward, aux_loss_backward_scale=aux_loss_backward_scale)
        self.out_features = out_features
        self.ffn_macs: int | None = None

    @layer_call(fixes_routing=True)
    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        x = self.run_pre(x)
        images = x.shape[0]
        vectors = self.gate_input(x)
        mode = Mode.of(vectors)
        routing = self.router.route(vectors, images, mode)
        shape = list(x.shape)
        shape[self.channels_dim] = self.out_features
        y = x.new_zeros(shape)
        if mode.exporting or mode.meta:  # no value can be read: every copy on every image
            y = self._dense_combine(x, routing, y, args)
        else:
            y = self._segments_combine(x, routing, y, args)
        if self.shared is not None:
            y = y + self.shared.forward_all(x, *args)
        if mode.exporting:  # an exported graph is a pure function: no routing state, no aux loss
            return y
        self.last_routing, self.last_items, self.last_images = routing, images, images  # routed units: images
        self.computed_aux_losses = {kind: AUX_LOSSES[kind](routing) for kind in self.aux_loss_weights}
        loss = self.weighted_aux_loss() if self.aux_loss_in_backward else None
        if loss is not None and loss.requires_grad:
            BACKWARD_SCALE_CHECK.on_forward(self, x)
            y = AuxLossAutoScaler.apply(y, loss, self.backward_scale)
        return y

    def _segments_combine(self, x: torch.Tensor, routing: Routing, y: torch.Tensor, args: tuple) -> torch.Tensor:
        """y plus each expert's copy on the images routed to it, weighted: a host sync, the segments are per
        expert."""
        start = 0
        for expert, count in enumerate(routing.counts.tolist()):
            if count:
                chosen = routing.item[start:start + count]
                out = self.experts.copies[expert](x[chosen], *args)
                weights = routing.weights[start:start + count].to(out.dtype).view(-1, *([1] * (out.dim() - 1)))
                y = y.index_add(0, chosen, out * weights)
            start += count
        return y

    def _dense_combine(self, x: torch.Tensor, routing: Routing, y: torch.Tensor, args: tuple) -> torch.Tensor:
        """y plus every copy on every image, weighted by the routing (0 where an image did not choose it): no value
        is read, and no shape depends on the data. The same function as `_segments_combine`, at E / k times the
        copies' compute; used only where no value can be read (torch.export, the meta device)."""
        experts = self.num_experts
        combine = routing.weights.new_zeros(x.shape[0] * experts).scatter_add(
            0, routing.item * experts + routing.expert, routing.weights).view(x.shape[0], experts)
        for expert, ffn in enumerate(self.experts.copies):
            out = ffn(x, *args)
            y = y + out * combine[:, expert].to(out.dtype).view(-1, *([1] * (out.dim() - 1)))
        return y

    def gate_input(self, x: torch.Tensor) -> torch.Tensor:
        """One vector per image [B, C] (the router's pool of the positions, channels last)."""
        channels_last = x if self.channels_dim in (-1, x.dim() - 1) else x.movedim(self.channels_dim, -1)
        return self.router.gate_input(channels_last.reshape(-1, channels_last.shape[-1]), x.shape[0])

    def experts_per_item(self, items: int, images: int) -> float:
        return self.router.experts_per_item(images, images)

    def activated_macs(self, items: int, images: int) -> int:
        """The gate once per image, k whole FFNs per image (`ffn_macs`, the dense FFN's traced MACs), the
        weighted combine (one MAC per output channel of each position of each chosen expert) and the shared
        copies."""
        return self._macs(items, images, self.experts_per_item(items, images))

    def exported_macs(self, items: int, images: int) -> int:
        """Every copy on every image, weighted (`_dense_combine`, what torch.export and the meta device run)."""
        return self._macs(items, images, self.num_experts)

    def _macs(self, items: int, images: int, k: float) -> int:
        if self.ffn_macs is None:
            raise RuntimeError("ImageFFNMoE.ffn_macs is not set: counting sets it from the dense model's trace")
        return round(self.router.gate_macs(items, images) + k * images * self.ffn_macs
                     + k * items * self.out_features + self.shared_macs() * images)

    def einsum_macs(self, items: int, images: int) -> int | None:
        return None

    def shared_macs(self) -> int:
        """MACs of the shared copies on one image."""
        return 0 if self.shared is None else self.shared.num_experts * (self.ffn_macs or 0)

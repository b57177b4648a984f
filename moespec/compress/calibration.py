"""Calibration: route images through a model and record, per sparse MoE layer, what pruning, merging and
densifying decide from.

    calibration_images(model, images)  a batch tensor as it is, or an image folder read with timm's eval
                                       transform for the model (`backbones.images`)
    calibrate(model, batches)          eval mode, no gradients; one forward hook per MoE layer

Per layer and expert e (over every routed item of every image):
- `load[e]`: the items that chose e (the router's `Routing.load`: top-k choices before any capacity drop);
- `reap[e]`: REAP's saliency (Lasby et al. 2025, "REAP: router-weighted expert activation pruning"), the mean
  over the items routed to e of g_e(x) * ||E_e(x)||_2, the gate weight times the norm of the expert's output;
- `mass`: the combine weights an item gets, summed over its experts, averaged over the items (1 for normalized
  top-k; densify scales the dense FFN by it).
A sample of the layer's items (`items`) and of its router's inputs (`gate_inputs`) is kept for merging.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..backbones.images import data_transform, image_files, read_images
from ..compiler import moe_layers, plan_of
from ..errors import MoespecError
from ..layers import MoE
from ..layers.routing import items_per_image

BATCH = 32  # images per forward
KEPT_ITEMS = 1024  # items (and router inputs) kept per layer for merging


def calibration_images(model: nn.Module, images: torch.Tensor | str | Path) -> torch.Tensor:
    """`images` as a batch [B, C, H, W]: a tensor as it is (already preprocessed), or every image file under a
    folder (subfolders too) through timm's eval transform for `model` at its spec's input size."""
    if isinstance(images, torch.Tensor):
        if images.dim() != 4 or images.shape[0] == 0:
            raise MoespecError(f"images: a batch [B, C, H, W] of at least one image is needed, got a tensor of shape "
                               f"{list(images.shape)}")
        return images
    plan = plan_of(model)
    _, transform = data_transform(model, tuple(plan.input_size), str(images))
    files, skipped = image_files(images), []
    read = read_images(files, transform, plan.input_size[0], skipped, purpose="calibration")
    if not read:
        raise MoespecError(f"{images}: no readable images ({len(skipped)} file(s) could not be read; first: "
                           f"{skipped[0]})")
    return torch.stack([tensor for _, tensor in read])


@dataclass
class LayerCalibration:
    """What one MoE layer did on the calibration images (see the module docstring)."""

    experts: int
    load: torch.Tensor = None  # [E] float64
    reap_sum: torch.Tensor = None  # [E] float64: sum of g * ||E(x)|| over the pairs
    pairs: torch.Tensor = None  # [E] float64: pairs that reached each expert
    mass_sum: float = 0.0
    items_seen: int = 0
    items: list[torch.Tensor] = field(default_factory=list)
    gate_inputs: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self):
        self.load = torch.zeros(self.experts, dtype=torch.float64)
        self.reap_sum = torch.zeros(self.experts, dtype=torch.float64)
        self.pairs = torch.zeros(self.experts, dtype=torch.float64)

    @property
    def reap(self) -> torch.Tensor:
        """[E] REAP saliency: the mean of g_e(x) * ||E_e(x)|| over the items routed to e (0 where none)."""
        return self.reap_sum / self.pairs.clamp(min=1)

    @property
    def mass(self) -> float:
        return self.mass_sum / max(self.items_seen, 1)

    def sample(self, name: str) -> torch.Tensor:
        rows = getattr(self, name)
        return torch.cat(rows)[:KEPT_ITEMS] if rows else torch.zeros(0)

    @torch.no_grad()
    def add(self, layer: MoE, x: torch.Tensor) -> None:
        """The last forward of `layer`, whose input was `x` (before `pre`)."""
        routing = layer.last_routing
        x = layer.run_pre(x)
        channels_last = x if layer.channels_dim in (-1, x.dim() - 1) else x.movedim(layer.channels_dim, -1)
        items = channels_last.reshape(-1, channels_last.shape[-1])
        self.load += routing.load.detach().double().cpu()
        kept = int(routing.counts.sum())
        pair_items = routing.item[:kept]
        groups = None
        if layer.experts.needs_groups:
            groups = torch.arange(x.shape[0], device=x.device).repeat_interleave(
                items_per_image(items.shape[0], x.shape[0]))[pair_items]
        out = layer.experts(items[pair_items], routing.counts, groups)[:kept]  # [P, C'], sorted by expert
        weights = routing.weights[:kept].double()
        experts = torch.repeat_interleave(torch.arange(self.experts, device=x.device), routing.counts)
        self.reap_sum.index_add_(0, experts.cpu(), (weights * out.double().norm(dim=-1)).cpu())
        self.pairs += routing.counts.detach().double().cpu()
        self.mass_sum += float(weights.sum())
        self.items_seen += items.shape[0]
        if sum(len(t) for t in self.items) < KEPT_ITEMS:
            self.items.append(items[:KEPT_ITEMS].detach().cpu())
            self.gate_inputs.append(layer.gate_input(x)[:KEPT_ITEMS].detach().cpu())


@torch.no_grad()
def calibrate(model: nn.Module, images: torch.Tensor) -> tuple[dict[str, LayerCalibration], torch.Tensor]:
    """Route `images` [B, C, H, W] through `model` (eval mode, restored after) in batches of `BATCH`; returns
    each sparse MoE layer's record, by path, and the model's outputs [B, ...] (its logits)."""
    layers = {path: layer for path, layer in moe_layers(model).items() if isinstance(layer, MoE)}
    records = {path: LayerCalibration(layer.num_experts) for path, layer in layers.items()}
    hooks = [layer.register_forward_hook(lambda module, args, output, path=path: records[path].add(module, args[0]))
             for path, layer in layers.items()]
    training = model.training
    device = next(model.parameters()).device
    try:
        model.eval()
        outputs = [model(images[i:i + BATCH].to(device)) for i in range(0, images.shape[0], BATCH)]
    finally:
        model.train(training)
        for hook in hooks:
            hook.remove()
    return records, torch.cat(outputs).detach().cpu()

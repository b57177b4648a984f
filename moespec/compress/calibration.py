"""Calibration: route images through a model and record, per sparse MoE layer, what pruning, merging and
densifying decide from.

    calibration_images(model, images)  the images as a stream of batches (`CalibrationImages`): a batch tensor
                                       cut into batches, or an image folder read a batch at a time with timm's
                                       eval transform for the model (`backbones.images`)
    calibrate(model, images)           eval mode, no gradients; one forward hook per MoE layer
    recording(model)                   the hooks of `calibrate`, around forwards the caller runs (`report.compare`
                                       runs the old and the new model batch by batch)

Per layer and expert e (over every routed item of every image):
- `load[e]`: the items that chose e (the router's `Routing.load`: top-k choices before any capacity drop);
- `reap[e]`: REAP's saliency (Lasby et al. 2025, "REAP: router-weighted expert activation pruning"), the mean
  over the items routed to e of g_e(x) * ||E_e(x)||_2, the gate weight times the norm of the expert's output;
- `mass`: the combine weights an item gets, summed over its experts, averaged over the items (1 for normalized
  top-k; densify scales the dense FFN by it).
A sample of the layer's items (`items`) and of its router's inputs (`gate_inputs`) is kept for merging.

Memory is constant in the number of images: one batch of images and its activations are held at a time, and
only the running sums above (and the bounded samples) stay; no image tensor, activation or logit is kept.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ..backbones.images import data_transform, image_files, read_images
from ..compiler import moe_layers, plan_of
from ..errors import MoespecError
from ..layers import MoE
from ..layers.routing import items_per_image

BATCH = 32  # images per forward
KEPT_ITEMS = 1024  # items (and router inputs) kept per layer for merging


class CalibrationImages:
    """Images as batches [b, C, H, W] of `BATCH`, read again on each pass: a tensor (already preprocessed) cut
    into batches, or every image file under a folder (subfolders too, sorted by path) through timm's eval
    transform for the model at its spec's input size, `BATCH` readable images at a time. Unreadable files are
    skipped; after a pass, `count` is the images read and `skipped` the files passed over ("path: reason").
    A pass that reads no image is an error."""

    def __init__(self, model: nn.Module, images: torch.Tensor | str | Path, purpose: str = "calibration"):
        self.images, self.purpose, self.skipped = images, purpose, []
        if isinstance(images, torch.Tensor):
            if images.dim() != 4 or images.shape[0] == 0:
                raise MoespecError(f"images: a batch [B, C, H, W] of at least one image is needed, got a tensor of "
                                   f"shape {list(images.shape)}")
            self.files, self.count = [], images.shape[0]
            return
        self.input_size = tuple(plan_of(model).input_size)
        _, self.transform = data_transform(model, self.input_size, str(images))
        self.files, self.count = image_files(images), 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        if isinstance(self.images, torch.Tensor):
            for start in range(0, self.count, BATCH):
                yield self.images[start:start + BATCH]
            return
        count, skipped, ready = 0, [], []
        for start in range(0, len(self.files), BATCH):
            read = read_images(self.files[start:start + BATCH], self.transform, self.input_size[0], skipped,
                               purpose=self.purpose)
            ready += [tensor for _, tensor in read]
            del read
            while len(ready) >= BATCH:  # the same batches as one tensor of every readable image would give
                batch, ready = torch.stack(ready[:BATCH]), ready[BATCH:]
                count += batch.shape[0]
                yield batch
                del batch
        if ready:
            count += len(ready)
            batch, ready = torch.stack(ready), []
            yield batch
        self.count, self.skipped = count, skipped
        if not count:
            raise MoespecError(f"{self.images}: no readable images ({len(skipped)} file(s) could not be read; "
                               f"first: {skipped[0]})")

    def skipped_line(self) -> str | None:
        """What the last pass skipped, in one line (None: nothing)."""
        if not self.skipped:
            return None
        return (f"{self.purpose}: skipped {len(self.skipped)} of {len(self.files)} files in {self.images} that are "
                f"not readable images (first: {self.skipped[0]})")


def calibration_images(model: nn.Module, images: torch.Tensor | str | Path | CalibrationImages,
                       purpose: str = "calibration") -> CalibrationImages:
    """`images` as a stream of batches for `model` (`CalibrationImages`); a stream as it is."""
    return images if isinstance(images, CalibrationImages) else CalibrationImages(model, images, purpose)


def skipped_lines(images: CalibrationImages | None) -> list[str]:
    """What the last pass over `images` skipped, as report lines (none for no images, or nothing skipped)."""
    line = None if images is None else images.skipped_line()
    return [] if line is None else [line]


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


@contextlib.contextmanager
def recording(model: nn.Module, record: bool = True) -> Iterator[dict[str, LayerCalibration]]:
    """Within the block, `model` in eval mode (restored after) with one forward hook per sparse MoE layer; yields
    each layer's record, by path, filled by the forwards the block runs (under `torch.no_grad`). `record`
    False: eval mode only, no hooks (and no records)."""
    layers = {path: layer for path, layer in moe_layers(model).items() if isinstance(layer, MoE) and record}
    records = {path: LayerCalibration(layer.num_experts) for path, layer in layers.items()}
    hooks = [layer.register_forward_hook(lambda module, args, output, path=path: records[path].add(module, args[0]))
             for path, layer in layers.items()]
    training = model.training
    try:
        model.eval()
        yield records
    finally:
        model.train(training)
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def calibrate(model: nn.Module, images: CalibrationImages | torch.Tensor) -> dict[str, LayerCalibration]:
    """Route `images` (a stream, or a tensor [B, C, H, W]) through `model` batch by batch; returns each sparse
    MoE layer's record, by path. The logits are not kept."""
    images = calibration_images(model, images)
    device = next(model.parameters()).device
    with recording(model) as records:
        for batch in images:
            model(batch.to(device))
    return records

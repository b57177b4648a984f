"""What the experts do: route a folder of labelled images through a model and tabulate, per MoE layer, the
share of each class's tokens (or images) that goes to each expert (as in ViMoE's routing heatmaps).

    find_images(DIR)              ImageFolder layout: DIR/CLASS/IMAGE, one subfolder per class
    load_model(spec | checkpoint) a spec is built with a random init, a checkpoint with its weights
    inspect_routing(model, ...)   eval mode, the model's timm data config; reads each layer's last routing
    write_report(report, out)     summary.json, a heatmap and a load chart per layer, index.html (`inspect_report.py`)

The numbers, per layer and class c (rows of `share`, one column per expert e):
(mass of class c at expert e) / (tokens of class c), where the mass is what the router kind's `inspect.tally`
counts for each image:
- token routers (top-k, expert choice): (item, expert) pairs. A token goes to k experts, so a row sums to k,
  less what capacity drops (expert choice: c on average);
- image routing: the same pairs; every token of an image goes where the image goes, so the share is
  (images of c sent to e) / (images of c) and a row sums to k;
- Soft MoE: the combine weight mass of e's slots: how much of the class's token outputs comes from e; a row
  sums to 1.

Per image, as ViMoE's Table 5 reports token routing (seed 003: 14.3 experts and 38.9M parameters per image):
the distinct experts of each layer that an image's items reached (those with a non-zero tally: at most E, k
for image routing, every expert for Soft MoE), averaged over the images, and the parameters those experts and
everything outside the routed experts hold (`activated_params_per_image`). The stats' activated parameters
count `k` experts per token; an image's tokens together reach more.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..backbones.images import IMAGE_SUFFIXES, read_images
from ..backbones.images import data_transform as image_transform
from ..compiler import create_model, moe_layers, plan_of
from ..distributed import expert_group
from ..errors import MoespecError
from ..planning import Plan
from ..planning.forward_cost import refuse_costly_forward
from ..spec import RouterSpec, load_spec
from ..spec.loading import SPEC_SUFFIXES
from ..weights import load


@dataclass(frozen=True)
class ImageFolder:
    """Labelled image files: `files[i] = (path, class index)`, classes sorted by name."""

    root: Path
    classes: tuple[str, ...]
    files: tuple[tuple[Path, int], ...]
    empty_classes: tuple[str, ...] = ()  # subfolders without image files, left out of `classes`


def find_images(root: str | Path, limit: int | None = None) -> ImageFolder:
    """The images of an ImageFolder layout (DIR/CLASS/IMAGE), at most `limit` per class (first by name)."""
    root = Path(root)
    if not root.is_dir():
        raise MoespecError(f"{root}: no such folder of images" + (" (it is a file)" if root.exists() else ""))
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise MoespecError(f"{root}: no class subfolders; expected one subfolder of images per class "
                           f"({root}/CLASS/IMAGE, as torchvision's ImageFolder)")
    classes, files, empty = [], [], []
    for folder in folders:
        images = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if not images:
            empty.append(folder.name)
            continue
        files += [(path, len(classes)) for path in images[:limit]]
        classes.append(folder.name)
    if not classes:
        raise MoespecError(f"{root}: no image files in its {len(folders)} class subfolder(s); image files end in "
                           f"{', '.join(IMAGE_SUFFIXES)}")
    return ImageFolder(root, tuple(classes), tuple(files), tuple(empty))


def load_model(source: str | Path, *, seed: int = 0, spec: str | Path | None = None, ema: bool = False,
               trust_pickle: bool = False) -> nn.Module:
    """A spec file (built with timm's random init, seeded) or a moespec checkpoint (.safetensors, a sharded
    index, or its folder), in eval mode. With `spec`, `source` is any checkpoint of that spec's model (a
    timm training checkpoint too: see `weights.load`)."""
    source = Path(source)
    if not source.exists():
        raise MoespecError(f"{source}: no such spec or checkpoint")
    if source.suffix in SPEC_SUFFIXES and spec is None:
        model = create_model(load_spec(source), seed=seed)
    else:
        model = load(source, spec=spec, ema=ema, trust_pickle=trust_pickle)
    if not moe_layers(model):
        raise MoespecError(f"{source}: the model has no MoE layers; there is no routing to inspect")
    return model.eval()


def data_transform(model: nn.Module, plan: Plan | None = None):
    """timm's eval transform for `model` at the input size of its plan (`plan_of(model)` unless given); returns
    (data config, transform). See `backbones.images.data_transform`."""
    plan = plan or plan_of(model)
    source = getattr(getattr(model, "moespec_spec", None), "source", None) or plan.name
    return image_transform(model, tuple(plan.input_size), source)


@dataclass(frozen=True)
class LayerRouting:
    """The routing of one MoE layer over the folder. `share[c][e]`: see the module docstring; `load[e]`:
    (item, expert) assignments expert e took over the whole folder (Soft MoE: its combine weight mass)."""

    path: str
    router: str  # the router kind
    router_name: str  # how the report names it: "top-2", "Soft MoE"
    share_label: str  # what a share is, the heatmap's colour bar
    unit: str  # what a row counts: "token" or "image"
    experts: int
    top_k: int
    share: list[list[float]]  # [class][expert]
    class_order: list[int]  # the heatmap's row order: by each class's top expert, then by its share there
    load: list[float]
    load_share: list[float]
    drop_fraction: float  # items that no expert took
    items: int  # items routed (tokens, or images for image routing)
    experts_per_image: float  # distinct experts an image's items reached, averaged over the images
    params_per_expert: int  # one routed expert's parameters


@dataclass(frozen=True)
class RoutingReport:
    """The routing of every MoE layer of a model over an ImageFolder."""

    source: str
    model: str
    input_size: tuple[int, int, int]
    data_config: dict[str, Any]
    classes: list[str]
    images_per_class: list[int]
    layers: list[LayerRouting]
    experts_per_image: float  # the layers' distinct experts per image, summed over the layers
    activated_params_per_image: float  # everything outside the routed experts + the experts an image reached
    skipped: list[str] = field(default_factory=list)  # unreadable files, "path: reason"
    empty_classes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Tally:
    """Per-class counts of one layer, summed over batches."""

    def __init__(self, classes: int, experts: int):
        self.assigned = torch.zeros(classes, experts, dtype=torch.float64)  # (token, expert) pairs / mass
        self.tokens = torch.zeros(classes, dtype=torch.float64)
        self.images = 0
        self.dropped = 0.0  # tokens no expert took
        self.experts_reached = 0.0  # distinct experts per image, summed over the images

    def add(self, layer: nn.Module, labels: torch.Tensor, tally: Callable) -> None:
        """Count the last forward of `layer` on images of classes `labels` [B], as its router kind's `tally`."""
        per_image = layer.last_items // layer.last_images  # items per image
        mass, dropped = tally(layer)  # [B, E], items no expert took
        self.assigned.index_add_(0, labels, mass)
        self.dropped += dropped
        self.experts_reached += float((mass > 0).sum())
        self.tokens.index_add_(0, labels, torch.full(labels.shape, float(per_image), dtype=torch.float64))
        self.images += len(labels)

    def result(self, path: str, layer: nn.Module, router: RouterSpec) -> LayerRouting:
        """Shares per class; for image routing, token pairs / tokens is the share of images (all the tokens
        of an image go where the image goes)."""
        share = self.assigned / self.tokens.clamp(min=1).unsqueeze(1)
        load = self.assigned.sum(dim=0)
        unit = router.inspection.unit
        return LayerRouting(
            path=path, router=router.kind, router_name=router.report_name(), share_label=router.inspection.share_label,
            unit=unit, experts=layer.num_experts, top_k=router.picks(),
            share=share.tolist(), class_order=class_order(share.tolist()), load=load.tolist(),
            load_share=(load / load.sum().clamp(min=1e-12)).tolist(),
            drop_fraction=self.dropped / float(self.tokens.sum()),
            items=self.images if unit == "image" else int(self.tokens.sum()),
            experts_per_image=self.experts_reached / max(self.images, 1),
            params_per_expert=sum(p[0].numel() for p in layer.experts.parameters()),  # [E, ...] stacks, this rank's
        )


def class_order(share: Sequence[Sequence[float]]) -> list[int]:
    """Row order that shows structure (ViMoE's figure): classes grouped by the expert that takes most of
    them, the groups in expert order, and within a group the classes that go there most first."""
    top = [max(range(len(row)), key=lambda e: (row[e], -e)) for row in share]
    return sorted(range(len(share)), key=lambda c: (top[c], -share[c][top[c]], c))


def inspect_routing(model: nn.Module, folder: ImageFolder, *, batch_size: int = 32, source: str = "",
                    on_batch: Callable[[str, int, int], None] | None = None) -> RoutingReport:
    """Route every image of `folder` through `model` (eval mode, no gradients) and tabulate each MoE layer's
    routing by class. Unreadable files are skipped and listed; none readable is an error."""
    plan = plan_of(model)
    config, transform = data_transform(model, plan)
    layers = moe_layers(model)
    routers = {path: layer.plan.router for path, layer in layers.items()}
    tallies = {path: _Tally(len(folder.classes), layer.num_experts) for path, layer in layers.items()}
    images_per_class, skipped = [0] * len(folder.classes), []
    batches = [folder.files[i:i + batch_size] for i in range(0, len(folder.files), batch_size)]
    _refuse_costly_batches(model, plan, len(batches[0]) if batches else 1)
    group = expert_group(model)  # experts sharded over ranks: each rank routes its share of the batches
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    mine, rounds = batches[rank::world], -(-len(batches) // world)
    model.eval()
    for done in range(rounds):
        batch = mine[done] if done < len(mine) else []
        if on_batch is not None and batch:
            on_batch(batch[0][0].parent.name, done * world, len(batches))
        tensors, labels = _read(batch, transform, config["input_size"][0], skipped)
        if not tensors and group is None:
            continue
        with torch.no_grad():  # a rank out of images still joins the others' exchanges, with a blank image
            model(torch.stack(tensors) if tensors else torch.zeros(1, *config["input_size"]))
        if not tensors:
            continue
        for path, layer in layers.items():
            tallies[path].add(layer, torch.tensor(labels), routers[path].inspection.tally)
        for label in labels:
            images_per_class[label] += 1
    if on_batch is not None:
        on_batch("", len(batches), len(batches))
    if group is not None:  # the counts of every rank
        images_per_class, skipped = _sum_over_ranks(tallies.values(), images_per_class, skipped, group)
    if not any(images_per_class):
        first = f"; first: {skipped[0]}" if skipped else ""
        raise MoespecError(f"{folder.root}: no readable images ({len(skipped)} file(s) could not be read{first})")
    results = [tallies[path].result(path, layer, routers[path]) for path, layer in layers.items()]
    routed = {id(p) for layer in layers.values() for p in layer.experts.parameters()}
    outside = sum(p.numel() for p in model.parameters() if id(p) not in routed)
    return RoutingReport(
        source=source, model=plan.name, input_size=tuple(plan.input_size),
        data_config={k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
        classes=list(folder.classes), images_per_class=images_per_class, layers=results,
        experts_per_image=sum(layer.experts_per_image for layer in results),
        activated_params_per_image=outside + sum(layer.experts_per_image * layer.params_per_expert
                                                 for layer in results),
        skipped=skipped, empty_classes=list(folder.empty_classes))


def _refuse_costly_batches(model: nn.Module, plan: Plan, batch: int) -> None:
    """Refuse, before any image is read, a batch whose forward (and images, each a float tensor at the input
    size, held beside it) is more than this machine affords (`planning.forward_cost`)."""
    spec = getattr(model, "moespec_spec", None)
    if spec is None:
        return
    images = batch * math.prod(plan.input_size) * 4
    refuse_costly_forward(spec, tuple(plan.input_size), f"routing a batch of {batch} image(s)", batch=batch,
                          held_bytes=images, runner="a batch",
                          hint="use a smaller batch size (--batch-size) or input size")


def _sum_over_ranks(tallies, images_per_class: list[int], skipped: list[str], group
                    ) -> tuple[list[int], list[str]]:
    """Sum the tallies and class counts over the ranks (in place / returned) and gather the skipped files."""
    for tally in tallies:
        numbers = torch.tensor([tally.images, tally.dropped, tally.experts_reached], dtype=torch.float64)
        for tensor in (tally.assigned, tally.tokens, numbers):
            dist.all_reduce(tensor, group=group)
        tally.images, tally.dropped, tally.experts_reached = int(numbers[0]), float(numbers[1]), float(numbers[2])
    counts = torch.tensor(images_per_class, dtype=torch.long)
    dist.all_reduce(counts, group=group)
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(everyone, skipped, group=group)
    return counts.tolist(), [line for lines in everyone for line in lines]


def _read(batch, transform, channels: int, skipped: list[str]) -> tuple[list[torch.Tensor], list[int]]:
    """Load and transform the readable images of a batch; note the others in `skipped`."""
    read = read_images([path for path, _ in batch], transform, channels, skipped, purpose="inspect")
    return [tensor for _, tensor in read], [batch[i][1] for i, _ in read]

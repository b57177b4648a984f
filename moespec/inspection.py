"""What the experts do: route a folder of labelled images through a model and tabulate, per MoE layer, the
share of each class's tokens (or images) that goes to each expert (as in ViMoE's routing heatmaps).

    find_images(DIR)              ImageFolder layout: DIR/CLASS/IMAGE, one subfolder per class
    load_model(spec | checkpoint) a spec is built with a random init, a checkpoint with its weights
    inspect_routing(model, ...)   eval mode, the model's timm data config; reads each layer's last routing
    write_report(report, out)     summary.json, a heatmap and a load chart per layer, index.html

The numbers, per layer and class c (rows of `share`, one column per expert e):
- token routers (`topk`, `expert_choice`): (tokens of class c sent to e) / (tokens of class c). A token goes
  to k experts, so a row sums to k, less what capacity drops (expert choice: c on average);
- image routing (`router.kind: image`): the same count per image: (images of c sent to e) / (images of c);
  every token of an image goes where the image goes, and a row sums to k;
- Soft MoE: the combine weight mass, (sum over the tokens of c of the combine weights of e's slots) /
  (tokens of c): how much of the class's token outputs comes from e; a row sums to 1. (The dispatch weights
  cannot show this: each slot's dispatch weights sum to 1 over the tokens of an image, so every expert
  gets the same dispatch mass from every image.)
"""

from __future__ import annotations

import html
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .errors import MoespecError
from .layers import SoftMoE

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
SPEC_SUFFIXES = (".yaml", ".yml")


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


def load_model(source: str | Path, *, seed: int = 0) -> nn.Module:
    """A spec file (built with timm's random init, seeded) or a moespec checkpoint (.safetensors, a sharded
    index, or its folder), in eval mode."""
    from .checkpoint import load
    from .compile import create_model, moe_layers
    from .spec import load_spec

    source = Path(source)
    if not source.exists():
        raise MoespecError(f"{source}: no such spec or checkpoint")
    if source.suffix in SPEC_SUFFIXES:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = create_model(load_spec(source))
    else:
        model = load(source)
    if not moe_layers(model):
        raise MoespecError(f"{source}: the model has no MoE layers; there is no routing to inspect")
    return model.eval()


def data_transform(model: nn.Module):
    """timm's eval transform for `model` (its pretrained_cfg: resize, crop, mean, std) at the spec's input
    size; returns (data config, transform)."""
    from timm.data import create_transform, resolve_data_config

    config = resolve_data_config({"input_size": tuple(model.moespec_plan.input_size)}, model=model)
    return config, create_transform(**config)


@dataclass(frozen=True)
class LayerRouting:
    """The routing of one MoE layer over the folder. `share[c][e]`: see the module docstring; `load[e]`:
    (item, expert) assignments expert e took over the whole folder (Soft MoE: its combine weight mass)."""

    path: str
    router: str  # topk | image | expert_choice | soft
    unit: str  # what a row counts: "token" or "image"
    experts: int
    top_k: int
    share: list[list[float]]  # [class][expert]
    class_order: list[int]  # the heatmap's row order: by each class's top expert, then by its share there
    load: list[float]
    load_share: list[float]
    drop_fraction: float  # items that no expert took
    items: int  # items routed (tokens, or images for image routing)


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

    def add(self, layer: nn.Module, labels: torch.Tensor) -> None:
        """Count the last forward of `layer` on images of classes `labels` [B]."""
        per_image = layer.last_items // layer.last_images  # items per image
        if isinstance(layer, SoftMoE):
            combine = layer.last_combine.detach().double()  # [B, N, S]
            mass = combine.reshape(*combine.shape[:2], layer.num_experts, -1).sum(dim=(1, 3))  # [B, E]
            self.assigned.index_add_(0, labels, mass)
        else:
            routing = layer.last_routing
            expert = torch.repeat_interleave(torch.arange(layer.num_experts), routing.counts.cpu())
            image = routing.item.cpu() // per_image
            self.assigned.index_put_((labels[image], expert), torch.ones(len(expert), dtype=torch.float64),
                                     accumulate=True)
            self.dropped += float((~routing.kept).sum())
        self.tokens.index_add_(0, labels, torch.full(labels.shape, float(per_image), dtype=torch.float64))
        self.images += len(labels)

    def result(self, path: str, layer: nn.Module, router: str) -> LayerRouting:
        """Shares per class; for image routing, token pairs / tokens is the share of images (all the tokens
        of an image go where the image goes)."""
        share = self.assigned / self.tokens.clamp(min=1).unsqueeze(1)
        load = self.assigned.sum(dim=0)
        unit = "image" if router == "image" else "token"
        return LayerRouting(
            path=path, router=router, unit=unit, experts=layer.num_experts, top_k=layer.top_k,
            share=share.tolist(), class_order=class_order(share.tolist()), load=load.tolist(),
            load_share=(load / load.sum().clamp(min=1e-12)).tolist(),
            drop_fraction=self.dropped / float(self.tokens.sum()),
            items=self.images if unit == "image" else int(self.tokens.sum()),
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
    from .compile import moe_layers

    config, transform = data_transform(model)
    layers = moe_layers(model)
    tallies = {path: _Tally(len(folder.classes), layer.num_experts) for path, layer in layers.items()}
    images_per_class, skipped = [0] * len(folder.classes), []
    batches = [folder.files[i:i + batch_size] for i in range(0, len(folder.files), batch_size)]
    model.eval()
    for done, batch in enumerate(batches):
        if on_batch is not None:
            on_batch(batch[0][0].parent.name, done, len(batches))
        tensors, labels = _read(batch, transform, config["input_size"][0], skipped)
        if not tensors:
            continue
        with torch.no_grad():
            model(torch.stack(tensors))
        for path, layer in layers.items():
            tallies[path].add(layer, torch.tensor(labels))
        for label in labels:
            images_per_class[label] += 1
    if on_batch is not None:
        on_batch("", len(batches), len(batches))
    if not any(images_per_class):
        first = f"; first: {skipped[0]}" if skipped else ""
        raise MoespecError(f"{folder.root}: no readable images ({len(skipped)} file(s) could not be read{first})")
    plan = model.moespec_plan
    return RoutingReport(
        source=source, model=plan.spec.name or plan.spec.backbone.model, input_size=tuple(plan.input_size),
        data_config={k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
        classes=list(folder.classes), images_per_class=images_per_class,
        layers=[tallies[path].result(path, layer, plan.layer(path).router.kind) for path, layer in layers.items()],
        skipped=skipped, empty_classes=list(folder.empty_classes))


def _read(batch, transform, channels: int, skipped: list[str]) -> tuple[list[torch.Tensor], list[int]]:
    """Load and transform the readable images of a batch; note the others in `skipped`."""
    from PIL import Image, UnidentifiedImageError

    tensors, labels = [], []
    for path, label in batch:
        try:
            with Image.open(path) as image:
                tensors.append(transform(image.convert("RGB" if channels == 3 else "L")))
        except (UnidentifiedImageError, OSError, ValueError) as error:
            skipped.append(f"{path}: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
            continue
        labels.append(label)
    return tensors, labels


def check_report_output(output: Path, force: bool) -> None:
    """Fail before any work if the report folder cannot be written."""
    if output.exists() and not output.is_dir():
        raise MoespecError(f"{output} is a file; the report is a folder")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise MoespecError(f"{output} already exists and is not empty; pass --force to replace it")
    if not output.absolute().parent.is_dir():
        raise MoespecError(f"{output.absolute().parent}: no such folder for the output")


def write_report(report: RoutingReport, output: str | Path, *, force: bool = False) -> Path:
    """Write the report folder: it is built next to `output` and renamed into place once complete, so
    `output` is always either the previous report or the whole new one."""
    output = Path(output)
    check_report_output(output, force)
    from .checkpoint import default_mode

    building = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.absolute().parent))
    try:
        _write_files(report, building)
        os.chmod(building, default_mode(directory=True))
        old = None
        if output.exists():
            old = output.with_name(f".{output.name}.old-{os.getpid()}")
            os.replace(output, old)
        os.replace(building, output)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if building.exists():
            shutil.rmtree(building)
    return output


def figure_names(index: int, layer: LayerRouting) -> dict[str, str]:
    stem = f"{index:02d}_{layer.path}"
    return {"heatmap": f"{stem}_routing.png", "load": f"{stem}_load.png"}


def _write_files(report: RoutingReport, folder: Path) -> None:
    from .plots import load_figure, routing_heatmap, save_figure

    summary = report.to_dict()
    for index, (layer, record) in enumerate(zip(report.layers, summary["layers"], strict=True)):
        names = figure_names(index, layer)
        record["figures"] = names
        rows = [report.classes[c] for c in layer.class_order]
        share = [layer.share[c] for c in layer.class_order]
        save_figure(routing_heatmap(_heatmap_title(layer), rows, share, _share_label(layer)), folder / names["heatmap"])
        save_figure(load_figure(_load_title(layer), layer.load_share), folder / names["load"])
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (folder / "index.html").write_text(_html(report, summary), encoding="utf-8")


def _router_text(layer: LayerRouting) -> str:
    if layer.router == "soft":
        return "Soft MoE"
    if layer.router == "expert_choice":
        return "expert choice"
    return f"{'image-level ' if layer.router == 'image' else ''}top-{layer.top_k}"


def _heatmap_title(layer: LayerRouting) -> str:
    return f"{layer.path}: routing by class ({_router_text(layer)}, {layer.experts} experts)"


def _share_label(layer: LayerRouting) -> str:
    if layer.router == "soft":
        return "share of the class's token outputs\n(combine weight mass)"
    return f"share of the class's {layer.unit}s\nsent to the expert"


def _load_title(layer: LayerRouting) -> str:
    return f"{layer.path}: expert load, {layer.drop_fraction:.1%} of {layer.unit}s dropped"


def _html(report: RoutingReport, summary: dict[str, Any]) -> str:
    """A static page that shows every figure, with the numbers that frame them."""
    e = html.escape
    counts = ", ".join(f"{e(name)} ({n})" for name, n in zip(report.classes, report.images_per_class, strict=True))
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>moespec inspect: {e(report.model)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1400px} img{max-width:100%;border:1px solid #ddd}"
        " .row{display:flex;gap:1em;flex-wrap:wrap;align-items:flex-start} td,th{padding:2px 8px;text-align:left}"
        "</style></head><body>",
        f"<h1>What the experts do: {e(report.model)}</h1>",
        "<table>",
        f"<tr><th>model</th><td>{e(report.source)}</td></tr>",
        f"<tr><th>input</th><td>{e(str(list(report.input_size)))}, timm data config {e(json.dumps(report.data_config))}</td></tr>",
        f"<tr><th>images</th><td>{sum(report.images_per_class)} in {len(report.classes)} classes: {counts}</td></tr>",
    ]
    if report.skipped:
        parts.append(f"<tr><th>skipped</th><td>{len(report.skipped)} unreadable file(s)</td></tr>")
    parts += ["</table>",
              "<p>Each heatmap row is a class, each column an expert; a cell is the share of the class's tokens "
              "(images, for image-level routing) that the layer sends to the expert, so a row sums to k, less the "
              "tokens dropped (expert choice: c on average; Soft MoE: the combine weight mass, a row sums to 1). "
              "Rows are grouped by the expert that takes most of the class. The numbers are in "
              "<a href='summary.json'>summary.json</a>.</p>"]
    for layer, record in zip(report.layers, summary["layers"], strict=True):
        figures = record["figures"]
        parts += [f"<h2>{e(layer.path)}</h2>",
                  f"<p>{e(_router_text(layer))}, {layer.experts} experts, {layer.items} {e(layer.unit)}s routed, "
                  f"{layer.drop_fraction:.2%} dropped</p>",
                  "<div class='row'>",
                  f"<img src='{e(figures['heatmap'])}' alt='routing heatmap of {e(layer.path)}'>",
                  f"<img src='{e(figures['load'])}' alt='expert load of {e(layer.path)}'>",
                  "</div>"]
    parts.append("</body></html>\n")
    return "\n".join(parts)

"""Accuracy over a labelled folder of images, as timm's validate.py measures it: `moespec eval`.

    load_classifier(source)   a moespec checkpoint (a file, a sharded index, a Hub folder) or a plain timm Hub
                              folder; a timm training checkpoint with the spec of its model
    evaluate(model, DIR)      top-1 and top-5 accuracy, the mean cross-entropy, each class's top-1, and each MoE
                              layer's expert load and dropped-item fraction

The folder is read as timm's ImageFolder reads it (`find_images_and_targets`: one subfolder per class, classes
in natural order, class i is logit i) and every image goes through timm's eval transform for the model's
pretrained_cfg (`resolve_data_config(use_test_size=True)` and `create_transform`: resize, center crop, mean and
std, interpolation), as validate.py with `--no-prefetcher` does; a moespec model built at another input size
than its pretrained_cfg's is evaluated at its own (the spec's `input_size`). Top-1 and top-5 are timm's
`accuracy`: a sample counts when its label is among the k largest logits. Unlike validate.py, an unreadable
file is skipped and counted, and image files ending in any of `backbones.images.IMAGE_SUFFIXES` are read.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import timm
import torch
import torch.nn.functional as F
from timm.data.readers.reader_image_folder import find_images_and_targets
from torch import nn

from ..backbones.images import IMAGE_SUFFIXES, data_transform, read_images
from ..backbones.placement import resolve_device
from ..compiler import moe_layers, plan_of
from ..errors import MoespecError
from ..planning.forward_cost import refuse_costly_forward
from ..spec import HUB_CONFIG, hub_config, is_hub_folder
from ..spec.loading import SPEC_SUFFIXES
from ..weights import load


@dataclass(frozen=True)
class LayerLoad:
    """One MoE layer over the folder: `load[e]`, the (item, expert) assignments expert e took (Soft MoE: its
    combine weight mass), as a share of all of them; the items no expert took."""

    path: str
    experts: int
    load_share: list[float]
    drop_fraction: float
    items: int


@dataclass(frozen=True)
class ClassAccuracy:
    name: str
    images: int
    top1: float | None  # percent; None for a class none of whose images could be read


@dataclass(frozen=True)
class EvalReport:
    source: str
    model: str
    data_config: dict[str, Any]
    images: int  # read and evaluated
    top1: float  # percent, as timm's validate.py prints it
    top5: float
    loss: float  # mean cross-entropy
    classes: list[ClassAccuracy]
    layers: list[LayerLoad]
    skipped: list[str] = field(default_factory=list)  # unreadable files, "path: reason"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_classifier(source: str | Path, *, device: str = "cpu", spec: str | Path | None = None, ema: bool = False,
                    trust_pickle: bool = False) -> nn.Module:
    """The model of `source` in eval mode on `device`: a moespec checkpoint or Hub folder (`weights.load`), a timm
    Hub folder of a dense model (`timm.create_model("local-dir:...", pretrained=True)`), or with `spec` any
    checkpoint of that spec's model (a timm training checkpoint too)."""
    source, where = Path(source), resolve_device(device)
    if not source.exists():
        raise MoespecError(f"{source}: no such checkpoint or Hub folder")
    if source.suffix in SPEC_SUFFIXES and spec is None:
        raise MoespecError(f"{source}: a spec holds no trained weights; give a checkpoint of its model (moespec "
                           f"upcycle writes one; a timm training checkpoint with --spec {source})")
    config = source / HUB_CONFIG
    if spec is None and is_hub_folder(source) and _timm_architecture(config):
        try:
            model = timm.create_model(f"local-dir:{source}", pretrained=True)
        except (RuntimeError, ValueError, KeyError, OSError) as error:
            raise MoespecError(f"{source}: timm cannot build this Hub folder's model: {error}") from None
        return model.to(where).eval()
    return load(source, spec=spec, device=where, ema=ema, trust_pickle=trust_pickle).eval()


def _timm_architecture(config: Path) -> bool:
    """Whether a Hub folder's config.json (read as `spec.hub_config` reads it: a plain file, bounded) names a
    timm model's architecture, one that is no moespec layout: timm builds that model. Any other (moespec's, another
    moespec release's, a missing or broken one) is `weights.load`'s to read, which says what is wrong with it."""
    architecture = hub_config(config.parent).get("architecture")
    return isinstance(architecture, str) and not architecture.startswith("moespec")


def labelled_images(root: str | Path) -> tuple[list[tuple[Path, int]], list[str]]:
    """(path, class index) of every image file under the ImageFolder `root`, and the class names, in timm's
    order (`find_images_and_targets`)."""
    root = Path(root)
    if not root.is_dir():
        raise MoespecError(f"{root}: no such folder of images" + (" (it is a file)" if root.exists() else ""))
    if not any(p.is_dir() and not p.name.startswith(".") for p in root.iterdir()):
        raise MoespecError(f"{root}: no class subfolders; expected one subfolder of images per class "
                           f"({root}/CLASS/IMAGE, as timm's and torchvision's ImageFolder)")
    samples, class_to_idx = find_images_and_targets(str(root), types=IMAGE_SUFFIXES)
    if not samples:
        raise MoespecError(f"{root}: no image files in its class subfolders; image files end in "
                           f"{', '.join(IMAGE_SUFFIXES)}")
    if "" in class_to_idx:
        raise MoespecError(f"{root}: image files directly in the folder; every image belongs in a class subfolder")
    return [(Path(path), label) for path, label in samples], sorted(class_to_idx, key=class_to_idx.get)


def _input_size(model: nn.Module) -> tuple[int, int, int] | None:
    """A moespec model's own input size where it differs from its pretrained_cfg's, else None (timm's pick)."""
    if getattr(model, "moespec_spec", None) is None:
        return None
    size = tuple(plan_of(model).input_size)
    return None if size == tuple(getattr(model, "pretrained_cfg", {}).get("input_size", ())) else size


def evaluate(model: nn.Module, root: str | Path, *, batch_size: int = 32, input_size: tuple[int, int, int] | None
             = None, source: str = "", on_batch: Callable[[str, int, int], None] | None = None) -> EvalReport:
    """Evaluate `model` (eval mode, no gradients) on every image of the ImageFolder `root`, on the model's device
    (see the module docstring). Unreadable files are skipped and listed; none readable is an error."""
    files, classes = labelled_images(root)
    config, transform = data_transform(model, input_size or _input_size(model), source or str(root),
                                       use_test_size=True)
    device = next(model.parameters()).device
    _refuse_costly(model, tuple(config["input_size"]), batch_size)
    layers = moe_layers(model) if getattr(model, "moespec_spec", None) is not None else {}
    loads = {path: torch.zeros(layer.num_experts, dtype=torch.float64) for path, layer in layers.items()}
    dropped, items = dict.fromkeys(layers, 0.0), dict.fromkeys(layers, 0)
    per_class, right = [0] * len(classes), [0] * len(classes)
    top1 = top5 = count = 0
    loss_sum, skipped = 0.0, []
    batches = [files[i:i + batch_size] for i in range(0, len(files), batch_size)]
    model.eval()
    for done, batch in enumerate(batches):
        if on_batch is not None:
            on_batch(batch[0][0].parent.name, done, len(batches))
        read = read_images([path for path, _ in batch], transform, config["input_size"][0], skipped, purpose="eval")
        if not read:
            continue
        labels = torch.tensor([batch[i][1] for i, _ in read], device=device)
        with torch.inference_mode():
            logits = model(torch.stack([tensor for _, tensor in read]).to(device)).float()
        if logits.shape[-1] < len(classes):
            raise MoespecError(f"{root}: {len(classes)} class subfolders, but the model has {logits.shape[-1]} "
                               f"classes (class i of the folder, in natural order, is logit i)")
        loss_sum += float(F.cross_entropy(logits, labels, reduction="sum"))
        hits = logits.topk(min(5, logits.shape[-1]), dim=-1).indices == labels[:, None]
        top1, top5, count = top1 + int(hits[:, :1].sum()), top5 + int(hits.sum()), count + len(labels)
        for label, hit in zip(labels.tolist(), hits[:, 0].tolist(), strict=True):
            per_class[label] += 1
            right[label] += int(hit)
        for path, layer in layers.items():
            mass, lost = layer.plan.router.inspection.tally(layer)  # [B, E], items no expert took
            loads[path] += mass.sum(dim=0).double().cpu()
            dropped[path] += float(lost)
            items[path] += int(layer.last_items)
    if on_batch is not None:
        on_batch("", len(batches), len(batches))
    if not count:
        first = f"; first: {skipped[0]}" if skipped else ""
        raise MoespecError(f"{root}: no readable images ({len(skipped)} file(s) could not be read{first})")
    return EvalReport(
        source=source, model=getattr(getattr(model, "moespec_spec", None), "name", None) or type(model).__name__,
        data_config={k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}, images=count,
        top1=100 * top1 / count, top5=100 * top5 / count, loss=loss_sum / count,
        classes=[ClassAccuracy(name, n, 100 * r / n if n else None)
                 for name, n, r in zip(classes, per_class, right, strict=True)],
        layers=[LayerLoad(path, layer.num_experts, (loads[path] / loads[path].sum().clamp(min=1e-12)).tolist(),
                          dropped[path] / max(items[path], 1), items[path]) for path, layer in layers.items()],
        skipped=skipped)


def _refuse_costly(model: nn.Module, input_size: tuple[int, int, int], batch: int) -> None:
    """Refuse, before any image is read, a batch whose forward is more than this machine affords."""
    spec = getattr(model, "moespec_spec", None)
    if spec is not None and next(model.parameters()).device.type == "cpu":
        refuse_costly_forward(spec, input_size, f"evaluating a batch of {batch} image(s)", batch=batch,
                              held_bytes=batch * math.prod(input_size) * 4, runner="a batch",
                              hint="use a smaller batch size (--batch) or input size")


def render(report: EvalReport, per_class: bool = False) -> str:
    """The report as text: accuracy and loss, each MoE layer's expert load, with `per_class` each class's top-1."""
    c = report.data_config
    lines = [f"{report.source or report.model}: {report.images} images, input {c['input_size']}, crop_pct "
             f"{c['crop_pct']}, {c['interpolation']}, mean {_short(c['mean'])}, std {_short(c['std'])}",
             f"top-1 {report.top1:.3f}%  top-5 {report.top5:.3f}%  loss {report.loss:.4f}"]
    if report.skipped:
        lines.append(f"skipped {len(report.skipped)} unreadable file(s); first: {report.skipped[0]}")
    for layer in report.layers:
        shares = " ".join(f"{share:.2f}" for share in layer.load_share)
        lines.append(f"{layer.path}: load per expert {shares} (uniform {1 / layer.experts:.2f}), dropped "
                     f"{100 * layer.drop_fraction:.1f}% of {layer.items} items")
    if per_class:
        lines += [f"  {cls.name}: top-1 {cls.top1:.2f}% of {cls.images}" if cls.images else
                  f"  {cls.name}: no readable images" for cls in report.classes]
    return "\n".join(lines) + "\n"


def _short(values) -> str:
    return "(" + ", ".join(f"{v:.3f}" for v in values) + ")"

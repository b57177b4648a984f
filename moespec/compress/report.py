"""What a prune, merge or densify cost, measured on images: top-1 agreement and relative logit error against the
model before, each layer's loads before and after, and params / activated params / GMACs before and after in
`moespec stats`'s table (`counting.render`)."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ..counting import SpecStats, render, stats
from .calibration import CalibrationImages, LayerCalibration, recording
from .surgery import spec_of


@dataclass(frozen=True)
class LayerChange:
    """One MoE layer: its experts before and after, where each new expert came from, and the loads (each
    expert's share of the routed choices on the compared images) before and after."""

    path: str
    experts_before: int
    experts_after: int  # 0: the layer became a dense FFN
    sources: list[list[int]]  # per new expert, the old experts it was made from
    load_before: list[float]
    load_after: list[float]


@dataclass(frozen=True)
class CompressReport:
    operation: str  # "prune", "merge", "densify"
    images: int  # images compared on (0: none given)
    top1_agreement: float | None  # share of images whose top-1 class is the same as before
    relative_logit_error: float | None  # ||after - before|| / ||before|| over the images' logits
    layers: list[LayerChange]
    before: SpecStats
    after: SpecStats
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # per image folder, the unreadable files passed over, in words

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        lines = list(self.skipped)
        if self.images:
            lines.append(f"{self.operation}: on {self.images} images: top-1 agreement "
                         f"{100 * self.top1_agreement:.1f}%, relative logit error {self.relative_logit_error:.4g} "
                         f"(||after - before|| / ||before||)")
        else:
            lines.append(f"{self.operation}: no images given; nothing measured")
        for layer in self.layers:
            after = f"{layer.experts_after} experts" if layer.experts_after else "dense FFN"
            word = " kept " if self.operation == "prune" else " from "
            made = "" if not layer.experts_after else word + " ".join("+".join(map(str, g)) for g in layer.sources)
            lines.append(f"{layer.path}: {layer.experts_before} experts -> {after}{made}")
            if layer.load_before:
                lines.append(f"  load before: {_shares(layer.load_before)}")
            if layer.load_after:
                lines.append(f"  load after:  {_shares(layer.load_after)}")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines) + "\n" + render([self.before, self.after], "table")


def _shares(load: list[float]) -> str:
    return "[" + " ".join(f"{share:.3f}" for share in load) + "]"


def shares(record: LayerCalibration | None) -> list[float]:
    if record is None:
        return []
    total = float(record.load.sum())
    return [float(x) / total if total else 0.0 for x in record.load]


@torch.no_grad()
def compare(operation: str, old: nn.Module, new: nn.Module, images: CalibrationImages | None,
            changes: dict[str, tuple[int, list[list[int]]]], *, dense: bool = False,
            before: dict[str, LayerCalibration] | None = None, notes: list[str] | None = None,
            skipped: list[str] | None = None) -> CompressReport:
    """The report of `old` -> `new` on `images` (None: counts only). `changes`: per changed layer, its experts
    before and each new expert's old ones (`dense`: the layer became one dense FFN). `before`: `old`'s records
    on `images`, where already computed. Both models run batch by batch; the agreement and the logit error are
    running sums, so no logits are kept. `skipped`: lines on unreadable files passed over before."""
    top1 = error = None
    after: dict[str, LayerCalibration] = {}
    skipped = list(skipped or [])
    if images is not None:
        agree = squared_error = squared_norm = 0.0
        devices = next(old.parameters()).device, next(new.parameters()).device
        with contextlib.ExitStack() as stack:
            old_records = stack.enter_context(recording(old, record=before is None))
            after = stack.enter_context(recording(new))
            for batch in images:
                logits = old(batch.to(devices[0])).double().cpu()
                new_logits = new(batch.to(devices[1])).double().cpu()
                agree += float((new_logits.argmax(-1) == logits.argmax(-1)).sum())
                squared_error += float(((new_logits - logits) ** 2).sum())
                squared_norm += float((logits ** 2).sum())
        before = old_records if before is None else before
        top1 = agree / images.count
        error = squared_error ** 0.5 / max(squared_norm ** 0.5, 1e-30)
        line = images.skipped_line()
        if line is not None and line not in skipped:
            skipped.append(line)
    before = before or {}
    layers = [LayerChange(path, experts, 0 if dense else len(groups), groups, shares(before.get(path)),
                          shares(after.get(path))) for path, (experts, groups) in changes.items()]
    return CompressReport(operation, 0 if images is None else images.count, top1, error, layers,
                          stats(spec_of(old)), stats(new.moespec_spec), notes or [], skipped)

"""Pruning: keep the best N experts of each sparse MoE layer, scored on calibration images.

Per layer, experts that no image routes to (load 0) go first; the others are ranked by their score, REAP's
router-weighted output norm by default (`calibration.py`), or their load (`score="load"`). The best `keep` stay,
in their order; the router's rows of the others (gate rows or expert codes, balancing biases) go with them.

Exact where it must be: an expert that no item chooses changes no output when it goes, for routers whose kept
weights do not depend on the other experts' scores: normalized top-k (`normalize: true`) and sigmoid scores. Under
an unnormalized softmax the kept gates grow by the removed experts' share of the softmax mass.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from ..errors import MoespecError
from ..layers import MoE
from .calibration import calibrate, calibration_images, skipped_lines
from .report import CompressReport, compare
from .surgery import expert_names, new_spec, rebuilt, router_rows, sparse_layers, spec_of

Score = Literal["reap", "load"]
Images = torch.Tensor | str | Path


def kept_count(keep: int | float, layer: MoE, path: str, operation: str = "prune", option: str = "keep") -> int:
    """Experts to keep in the layer at `path`: `keep` itself (an int), or that fraction of its experts (a float in
    (0, 1), rounded), between the router's top_k (and eval_top_k) and the layer's experts."""
    experts = layer.num_experts
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or keep <= 0 or (
            isinstance(keep, float) and keep >= 1):
        raise MoespecError(f"{option} must be a number of experts (1 or more) or a fraction in (0, 1), got {keep!r}")
    count = keep if isinstance(keep, int) else round(keep * experts)
    router = layer.plan.router
    picks = max(router.picks(), router.eval_picks())
    where = f"{path} (moe.{layer.plan.group})"
    if count > experts:
        raise MoespecError(f"{operation}: {option} {count} is more than the {experts} experts of {where}")
    if count < picks:
        raise MoespecError(f"{operation}: {option} {count} is fewer than the {picks} experts each item uses in "
                           f"{where} (top_k); keep at least {picks}")
    return count


def group_counts(layers: dict[str, MoE], counts: dict[str, int]) -> dict[int, int]:
    """The experts of each MoE group (one `experts:` per group in the spec)."""
    return {layer.plan.group: counts[path] for path, layer in layers.items()}


def prune_with_report(model: nn.Module, images: Images, keep: int | float, *, score: Score = "reap",
                      compare_on: Images | None = None) -> tuple[nn.Module, CompressReport]:
    """`prune`, plus what it cost (`report.CompressReport`) on `compare_on` (default: the calibration images)."""
    layers = sparse_layers(model, "prune")
    counts = {path: kept_count(keep, layer, path) for path, layer in layers.items()}
    if score not in ("reap", "load"):
        raise MoespecError(f"score must be reap or load, got {score!r}")
    batch = calibration_images(model, images)
    records = calibrate(model, batch)
    kept: dict[str, list[int]] = {}
    for path, layer in layers.items():
        record = records[path]
        value = record.reap if score == "reap" else record.load
        order = sorted(range(layer.num_experts), key=lambda e: (bool(record.load[e] > 0), float(value[e]),
                                                                float(record.load[e]), -e), reverse=True)
        kept[path] = sorted(order[:counts[path]])
    spec = new_spec(spec_of(model), group_counts(layers, counts), f"prune{_label(keep)}")

    def layer_state(path: str, name: str, old: torch.Tensor) -> torch.Tensor | None:
        if path in kept and name in expert_names(layers[path]) | router_rows(layers[path]):
            return old[kept[path]]
        return None

    new = rebuilt(model, spec, layer_state)
    again = compare_on is not None
    checked = calibration_images(model, compare_on, "comparison") if again else batch
    changes = {path: (layers[path].num_experts, [[e] for e in experts]) for path, experts in kept.items()}
    report = compare("prune", model, new, checked, changes, before=None if again else records,
                     notes=[f"score: {score}"], skipped=skipped_lines(batch))
    return new, report


def prune(model: nn.Module, images: Images, keep: int | float, *, score: Score = "reap") -> nn.Module:
    """A new model with the best `keep` experts of each sparse MoE layer (a number, or a fraction of each layer's
    experts), scored on `images` (a batch [B, C, H, W] already preprocessed, or an image folder); the router rows
    of the removed experts go, and the kept experts keep their order. `model` is left as it is. See the module
    docstring for the score and what is exact."""
    return prune_with_report(model, images, keep, score=score)[0]


def _label(keep: int | float) -> str:
    return str(keep) if isinstance(keep, int) else f"{math.floor(100 * keep)}pct"

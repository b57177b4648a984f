"""Merging: each sparse MoE layer's E experts into N, grouped by similarity and averaged after alignment.

    group    average-linkage clustering (HC-SMoE, Chen et al. 2024) of the experts by the cosine similarity of
             their outputs on a sample of the calibration items (`by="output"`), or of their router rows
             (`by="router"`)
    align    within a group, each expert's hidden units are permuted to line up with the group's most used
             expert by weight matching (MC-SMoE, Li et al. 2024): the Hungarian assignment maximizing the inner
             products of the units' weights (fc1 rows, fc1 bias, inner norm, fc2 column; `matching.py`)
    average  the aligned experts weighted by usage (their loads on the images; equal where a group has none)
    router   each merged expert's rows (gate rows or codes, balancing bias) are its group's, usage-weighted; then
             the gate is fitted on the calibration items (cross-entropy) so that an item's top-1 merged expert is
             the group of its old top-1: a merged expert is chosen where its group was

Exact where it must be: experts that compute the same function (identical, or identical up to an order of their
hidden units) merge into that function, and under a normalized router (whose weights sum to 1) no output changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import MoespecError
from ..layers import MoE
from .calibration import LayerCalibration, calibrate, calibration_images, skipped_lines
from .matching import cluster, match_units
from .prune import group_counts, kept_count
from .report import CompressReport, compare
from .surgery import (
    expert_names,
    expert_state,
    new_spec,
    permuted,
    rebuilt,
    router_rows,
    sparse_layers,
    spec_of,
    unit_features,
)

By = Literal["output", "router"]
Images = torch.Tensor | str | Path
FIT_STEPS = 200  # Adam steps of the router fit


def usage(record: LayerCalibration) -> torch.Tensor:
    """[E] each expert's load, as weights (all 1 where nothing was routed)."""
    return record.load if float(record.load.sum()) > 0 else torch.ones_like(record.load)


@torch.no_grad()
def similarity(layer: MoE, record: LayerCalibration, by: By) -> torch.Tensor:
    """[E, E] cosine similarity of the experts' outputs on the sampled items, or of their router rows."""
    if by == "output" and layer.experts.needs_groups:
        raise MoespecError("merge: grouping by output runs every expert on the same items, which GRN experts "
                           "(normalized per image over the positions they receive) cannot; group by router")
    if by == "router":
        rows = layer.router.gate.weight.detach().double()
    else:
        items = record.sample("items").to(layer.experts.fc1.weight)
        out = layer.experts.batched(items.unsqueeze(0).expand(layer.num_experts, *items.shape))  # [E, M, C']
        rows = out.reshape(layer.num_experts, -1).double()
    rows = F.normalize(rows, dim=1)
    return rows @ rows.T


def aligned_average(layer: MoE, members: list[int], weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """The usage-weighted average of the experts `members` (weights [len(members)], summing to 1), each aligned
    to the member of the largest weight first."""
    hidden = layer.experts.hidden
    anchor = members[int(weights.argmax())]
    reference = expert_state(layer.experts, anchor)
    features = unit_features(reference, hidden)
    merged: dict[str, torch.Tensor] = {}
    for member, weight in zip(members, weights.tolist(), strict=True):
        state = reference if member == anchor else expert_state(layer.experts, member)
        if member != anchor:
            state = permuted(state, match_units(features, unit_features(state, hidden)), hidden)
        for name, tensor in state.items():
            merged[name] = merged.get(name, 0) + weight * tensor.double()
    return merged


def merge_layer(layer: MoE, record: LayerCalibration, into: int, by: By
                ) -> tuple[list[list[int]], torch.Tensor, dict[str, torch.Tensor]]:
    """The groups, the router's combine matrix [N, E] and the merged experts' stacked tensors (bank names)."""
    groups = cluster(similarity(layer, record, by), into)
    loads = usage(record)
    combine = torch.zeros(len(groups), layer.num_experts, dtype=torch.float64)
    experts = []
    for g, members in enumerate(groups):
        weights = loads[members] / loads[members].sum() if float(loads[members].sum()) > 0 else \
            torch.full((len(members),), 1.0 / len(members), dtype=torch.float64)
        combine[g, members] = weights
        experts.append(aligned_average(layer, members, weights))
    stacked = {name: torch.stack([e[name] for e in experts]) for name in experts[0]}
    return groups, combine, stacked


def fit_router(old: MoE, new: MoE, record: LayerCalibration, groups: list[list[int]]) -> tuple[float, float]:
    """Fit `new`'s gate (its router weights, started at the usage-weighted rows) so that each sampled router input
    picks, as its top-1 merged expert, the group of its old top-1 expert: `FIT_STEPS` Adam steps of cross-entropy
    on those labels. Returns the routing agreement (the share of inputs whose new top-1 is the group of their old
    top-1) before and after; the rows that agree more are kept."""
    inputs = record.sample("gate_inputs").to(new.experts.fc1.weight)
    if inputs.numel() == 0:
        return float("nan"), float("nan")
    group_of = torch.empty(old.num_experts, dtype=torch.long, device=inputs.device)
    for g, members in enumerate(groups):
        group_of[members] = g
    with torch.no_grad():
        labels = group_of[old.router.gate(inputs).argmax(-1)]
    weights = new.router_weights()
    start = [w.detach().clone() for w in weights]

    def agreement() -> float:
        with torch.no_grad():
            return (new.router.gate(inputs).argmax(-1) == labels).double().mean().item()

    before = agreement()
    optimizer = torch.optim.Adam(weights, lr=1e-3)
    with torch.enable_grad():
        for _ in range(FIT_STEPS):
            optimizer.zero_grad()
            F.cross_entropy(new.router.gate(inputs).float(), labels).backward()
            optimizer.step()
    for w in weights:
        w.grad = None
    after = agreement()
    if after < before:
        with torch.no_grad():
            for w, value in zip(weights, start, strict=True):
                w.copy_(value)
    return before, max(before, after)


def merge_with_report(model: nn.Module, images: Images, into: int | float, *, by: By = "output",
                      fit: bool = True, compare_on: Images | None = None) -> tuple[nn.Module, CompressReport]:
    """`merge`, plus what it cost (`report.CompressReport`) on `compare_on` (default: the calibration images)."""
    layers = sparse_layers(model, "merge")
    counts = {path: kept_count(into, layer, path, "merge", "into") for path, layer in layers.items()}
    if by not in ("output", "router"):
        raise MoespecError(f"by must be output or router, got {by!r}")
    batch = calibration_images(model, images)
    records = calibrate(model, batch)
    merged = {path: merge_layer(layer, records[path], counts[path], by) for path, layer in layers.items()}
    spec = new_spec(spec_of(model), group_counts(layers, counts), f"merge{counts[next(iter(counts))]}")

    def layer_state(path: str, name: str, old: torch.Tensor) -> torch.Tensor | None:
        if path not in merged:
            return None
        _, combine, experts = merged[path]
        if name in expert_names(layers[path]):
            return experts[name[len("experts."):]].to(old.dtype)
        if name in router_rows(layers[path]):
            return torch.einsum("ne,e...->n...", combine, old.double().cpu()).to(old.dtype)
        return None

    new = rebuilt(model, spec, layer_state)
    notes = [f"grouped by {by}"]
    if fit:
        new_layers = {path: layer for path, layer in new.named_modules() if path in merged}
        for path, layer in new_layers.items():
            before, after = fit_router(layers[path], layer, records[path], merged[path][0])
            notes.append(f"{path}: the router's top-1 is the group of the old top-1 for {100 * after:.1f}% of "
                         f"{len(records[path].sample('gate_inputs'))} sampled router inputs ({100 * before:.1f}% "
                         f"with the averaged rows, before the fit)")
    again = compare_on is not None
    checked = calibration_images(model, compare_on, "comparison") if again else batch
    changes = {path: (layers[path].num_experts, groups) for path, (groups, _, _) in merged.items()}
    report = compare("merge", model, new, checked, changes, before=None if again else records,
                     notes=notes, skipped=skipped_lines(batch))
    return new, report


def merge(model: nn.Module, images: Images, into: int | float, *, by: By = "output", fit: bool = True
          ) -> nn.Module:
    """A new model whose sparse MoE layers each have `into` experts (a number, or a fraction of the layer's),
    merged from groups of similar experts measured on `images` (a batch [B, C, H, W] already preprocessed, or
    an image folder); see the module docstring. `model` is left as it is."""
    return merge_with_report(model, images, into, by=by, fit=fit)[0]

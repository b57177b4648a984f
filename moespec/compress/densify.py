"""Densifying: an MoE model back into its dense timm backbone, each MoE layer one dense FFN again.

    experts  the usage-weighted average of the layer's experts, each aligned to the most used one by weight
             matching (`how="average"`; equal weights without images), or the most used expert (`how="top"`)
    scale    times the combine mass an item got on the images (the sum of its experts' weights: 1 under
             normalized top-k), folded into fc2
    shared   shared experts are folded in as further hidden units beside the routed ones (their outputs add up,
             as they did), where the dense FFN has room for them and no inner norm couples its units
    map      the FFN's tensors are found by inverting the family's upcycling map (`Adapter.expert_state`, a
             selection of the dense weights): each entry goes back where upcycling would have taken it from

The result is the plain timm model (with the spec of its backbone, `moe: []`): its state dict loads into
`timm.create_model(...)` with `strict=True`. Exact where it must be: a freshly upcycled model (identical experts,
normalized top-k, no shared experts) densifies into the dense model it came from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from torch import nn

from ..backbones import adapter_named
from ..compiler import moe_layers
from ..errors import MoespecError
from ..layers import MoE
from ..spec import load_spec
from .calibration import calibrate, calibration_images, skipped_lines
from .merge import aligned_average
from .report import CompressReport, compare
from .surgery import build_like, expert_state, refuse_sharded, spec_of

How = Literal["average", "top"]
Images = torch.Tensor | str | Path


def dense_spec(model: nn.Module):
    """The spec of `model`'s dense backbone: no MoE layers (refused where `rescale` rebuilt blocks)."""
    spec = spec_of(model)
    if spec.rescale:
        raise MoespecError("densify: the spec rebuilds blocks at a rescaled shape (rescale:); the dense timm model "
                           "has no blocks of that shape to put them back into")
    document = spec.model_dump(mode="json")
    document["moe"], document["upcycle"]["experts_from"] = [], None
    document["name"] = f"{spec.name or spec.backbone.model}-dense"
    return load_spec(document)


def layer_weights(layer: MoE, load: torch.Tensor | None, how: How, path: str) -> torch.Tensor:
    """[E] the experts' weights in the dense FFN (summing to 1)."""
    experts = layer.num_experts
    if how == "top":
        if load is None:
            raise MoespecError("densify: how=top keeps the most used expert, which needs images to measure use")
        return torch.nn.functional.one_hot(load.argmax(), experts).double()
    if load is None or float(load.sum()) == 0:
        return torch.full((experts,), 1.0 / experts, dtype=torch.float64)
    return load / load.sum()


def dense_ffn(layer: MoE, path: str, template: dict[str, torch.Tensor], merged: dict[str, torch.Tensor]
              ) -> dict[str, torch.Tensor]:
    """The dense FFN's state (names and shapes of `template`) holding the expert `merged` (bank names) in its
    leading hidden units, the shared experts after them, and the layer's `pre` and bank buffers, found by
    inverting `Adapter.expert_state` on tensors of entry ids."""
    plan = layer.plan
    adapter = adapter_named(plan.family)
    shared = [] if layer.shared is None else [expert_state(layer.shared, s) for s in range(layer.shared.num_experts)]
    routed, width = layer.experts.hidden, plan.dense_hidden
    shared_width = sum(layer.shared.hidden for _ in shared) if shared else 0
    coupled = layer.experts.inner_norm != "none"
    if routed + shared_width > width or (coupled and routed + shared_width != width):
        what = f"{len(shared)} shared expert(s) of {layer.shared.hidden} hidden units beside " if shared else ""
        raise MoespecError(f"densify: {path}: {what}the routed experts' {routed} hidden units do not fit the dense "
                           f"FFN's {width}" + (" (its inner norm couples every unit)" if coupled else "")
                           + "; a dense FFN of the backbone's shape cannot compute their sum")
    ids, offset = {}, 0
    for name, tensor in template.items():
        ids[name] = torch.arange(offset, offset + tensor.numel(), dtype=torch.float64).reshape(tensor.shape)
        offset += tensor.numel()
    flat, covered = torch.zeros(offset, dtype=torch.float64), torch.zeros(offset, dtype=torch.bool)
    parts = [(merged, torch.arange(routed))]
    start = routed
    for state in shared:
        parts.append((state, torch.arange(start, start + layer.shared.hidden)))
        start += layer.shared.hidden

    def place(where: dict[str, torch.Tensor], values: dict[str, torch.Tensor], add: bool) -> None:
        for name, index in where.items():
            index = index.flatten()
            if not bool((index == index.round()).all()) or index.min() < 0 or index.max() >= offset:
                raise MoespecError(f"densify: {path}: the {plan.family} experts are not a selection of the dense "
                                   f"FFN's weights (upcycling folds a BatchNorm into their projections), so densify "
                                   f"cannot put them back into the FFN's modules")
            index, value = index.long(), values[name].double().flatten()
            flat.index_add_(0, index, value) if add else flat.index_copy_(0, index, value)
            covered[index] = True

    for state, units in parts:
        place(adapter.expert_state(ids, units), state, add=True)
    if layer.pre is not None:
        place(adapter.pre_state(ids), layer.pre.state_dict(), add=False)
    place(adapter.bank_buffers(ids), dict(layer.experts.named_buffers()), add=False)
    missing = [name for name, index in ids.items() if not bool(covered[index.flatten().long()].any())]
    if missing:
        raise MoespecError(f"densify: {path}: nothing in the MoE layer maps to the dense FFN's {', '.join(missing)}")
    return {name: flat[index.flatten().long()].reshape(template[name].shape).to(template[name].dtype)
            for name, index in ids.items()}


def densify_with_report(model: nn.Module, images: Images | None = None, *, how: How = "average",
                        compare_on: Images | None = None) -> tuple[nn.Module, CompressReport]:
    """`densify`, plus what it cost on `compare_on` (default: the images; without either, the counts only)."""
    if how not in ("average", "top"):
        raise MoespecError(f"how must be average or top, got {how!r}")
    spec = dense_spec(model)
    layers = moe_layers(model)
    if not layers:
        raise MoespecError("densify: the model has no MoE layers; it is dense already")
    refuse_sharded(layers, "densify")
    for path, layer in layers.items():
        if not isinstance(layer, MoE):
            raise MoespecError(f"densify: {path} ({layer.plan.router.title}) cannot be densified: its experts see "
                               f"slots that mix all the tokens, which no per-token FFN computes")
    batch = calibration_images(model, images) if images is not None else None
    records = calibrate(model, batch) if batch is not None else {}
    dense = build_like(model, spec)
    state = model.state_dict()
    notes = [f"experts: {'usage-weighted average, aligned' if how == 'average' else 'the most used one'}"
             + ("" if batch is not None else " (equal weights: no images)")]
    with torch.no_grad():
        ffns = {}
        for path, layer in layers.items():
            record = records.get(path)
            weights = layer_weights(layer, None if record is None else record.load, how, path)
            members = [e for e in range(layer.num_experts) if float(weights[e]) > 0]
            merged = aligned_average(layer, members, weights[members]) if len(members) > 1 else \
                {name: t.double() for name, t in expert_state(layer.experts, members[0]).items()}
            mass = record.mass if record is not None else 1.0
            for name in ("fc2.weight", "fc2.bias"):
                if name in merged:
                    merged[name] = merged[name] * mass
            notes.append(f"{path}: combine mass {mass:.4g} folded into fc2" if record is not None else
                         f"{path}: combine mass taken as 1 (no images)")
            template = dense.get_submodule(path).state_dict()
            ffns.update({f"{path}.{name}": t for name, t in dense_ffn(layer, path, template, merged).items()})
        for name, tensor in dense.state_dict().items():
            tensor.copy_(ffns[name] if name in ffns else state[name])
    dense = dense.to(next(model.parameters()).device).train(model.training)
    again = compare_on is not None
    checked = calibration_images(model, compare_on, "comparison") if again else batch
    changes = {path: (layer.num_experts, [list(range(layer.num_experts))]) for path, layer in layers.items()}
    report = compare("densify", model, dense, checked, changes, dense=True, before=None if again else records,
                     notes=notes, skipped=skipped_lines(batch))
    return dense, report


def densify(model: nn.Module, images: Images | None = None, *, how: How = "average") -> nn.Module:
    """The dense timm backbone of `model` (its class, with the spec `moe: []`): each MoE layer one dense FFN,
    made from its experts as the module docstring says, weighted by their use on `images` (a batch [B, C, H, W]
    already preprocessed, or an image folder) where given. `model` is left as it is."""
    return densify_with_report(model, images, how=how)[0]

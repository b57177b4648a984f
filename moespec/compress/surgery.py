"""What prune, merge and densify share: which layers they may change, the new spec, the new model filled from
the old one, and the hidden-unit view of an expert's tensors.

A layer of E experts becomes one of N by a matrix `combine` [N, E]: each of the router's per-expert tensors
(gate rows, expert codes, balancing biases: every tensor of the router with E rows) becomes `combine @ rows`, and
each new expert is built from the old ones by the operation (prune: one-hot rows, the kept experts in their order;
merge: each group's usage weights, after its experts' hidden units are aligned).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..compiler import create_model, moe_layers
from ..errors import MoespecError
from ..layers import MoE
from ..layers.routers import ChoiceRouter
from ..spec import Spec, load_spec
from ..weights.checkpoint import POOL_KEY, spec_of_head


def sparse_layers(model: nn.Module, operation: str) -> dict[str, MoE]:
    """The MoE layers of `model` whose experts `operation` (prune, merge) may remove: sparse layers whose items
    choose their top k over one gate row per expert (token choice, image routing). Any other layer is one clear
    error saying why."""
    layers = moe_layers(model)
    if not layers:
        raise MoespecError(f"{operation}: the model has no MoE layers")
    refuse_sharded(layers, operation)
    for path, layer in layers.items():
        router = layer.plan.router
        reason = router.fixed_experts
        if not reason and not (isinstance(layer, MoE) and isinstance(layer.router, ChoiceRouter)):
            reason = "its items do not choose among gate rows, one per expert"
        if not reason and layer.router.expert_groups is not None:
            reason = ("group-limited top-k (groups: {count, top}) splits the experts into equal groups, which "
                      "removing experts would break")
        if reason:
            raise MoespecError(f"{operation}: {path} ({router.title}, moe.{layer.plan.group}) cannot be "
                               f"{operation}d: {reason}")
    return layers


def refuse_sharded(layers: dict[str, nn.Module], operation: str) -> None:
    """Experts sharded over ranks (expert parallelism) are refused: each rank holds only some of them."""
    for path, layer in layers.items():
        if layer.experts.local_experts != layer.experts.num_experts:
            raise MoespecError(f"{operation}: {path}: this rank holds {layer.experts.local_experts} of its "
                               f"{layer.experts.num_experts} experts (expert parallelism); save the model and "
                               f"{operation} the checkpoint in one process")


def spec_of(model: nn.Module) -> Spec:
    """The spec `model` carries, with its head as it is now (a `reset_classifier` after the build)."""
    spec = getattr(model, "moespec_spec", None)
    if spec is None:
        raise MoespecError("this model was not built by moespec (no spec attached); build it with "
                           "moespec.create_model or load a moespec checkpoint")
    return spec_of_head(model, spec)[0]


def build_like(model: nn.Module, spec: Spec) -> nn.Module:
    """The model of `spec` (fresh weights), with the pooling `model`'s head has now where `reset_classifier` changed
    it after the build (as `weights.save` records it)."""
    new = create_model(spec)
    pool = spec_of_head(model, model.moespec_spec)[1].get(POOL_KEY)
    if pool is not None:
        new.reset_classifier(new.num_classes, global_pool=pool)
    return new


def new_spec(spec: Spec, experts: dict[int, int], suffix: str) -> Spec:
    """`spec` with `experts[g]` routed experts in MoE group g (`upcycle.experts_from`, one source per old expert,
    dropped: the experts are no longer the upcycled ones) and its name followed by `suffix`."""
    document = spec.model_dump(mode="json")
    for group, count in experts.items():
        document["moe"][group]["experts"] = count
    document["upcycle"]["experts_from"] = None
    document["name"] = f"{_name(spec)}-{suffix}"
    return load_spec(document)


def _name(spec: Spec) -> str:
    return spec.name or (Path(spec.source).stem if spec.source else spec.backbone.model)


def rebuilt(model: nn.Module, spec: Spec, layer_state: Callable[[str, str, torch.Tensor], torch.Tensor | None]
            ) -> nn.Module:
    """The model of `spec`, every tensor copied from `model` where the name and shape are the same;
    `layer_state(path, name, old)` gives the new tensor of an MoE layer's tensor (`name` within the layer at
    `path`), or None to copy it. On `model`'s device, in its mode; `model` is left as it is."""
    device = next(model.parameters()).device
    new = build_like(model, spec)
    old_state = model.state_dict()
    paths = sorted(moe_layers(model), key=len, reverse=True)
    with torch.no_grad():
        for name, tensor in new.state_dict().items():
            path = next((p for p in paths if name.startswith(p + ".")), None)
            value = layer_state(path, name[len(path) + 1:], old_state[name]) if path is not None else None
            value = old_state[name] if value is None else value
            if value.shape != tensor.shape:
                raise RuntimeError(f"{name}: built {list(tensor.shape)}, computed {list(value.shape)}")
            tensor.copy_(value)
    return new.to(device).train(model.training)


def router_rows(layer: MoE) -> set[str]:
    """Names (within the layer) of the router's tensors with one row per expert: gate rows or expert codes, the
    balancing bias."""
    experts = layer.num_experts
    return {f"router.{name}" for name, tensor in layer.router.state_dict().items()
            if tensor.dim() >= 1 and tensor.shape[0] == experts and not name.startswith("gate.proj")}


def expert_names(layer: MoE) -> set[str]:
    """Names (within the layer) of the routed experts' stacked tensors [E, ...]."""
    return {f"experts.{name}" for name in expert_state(layer.experts, 0)}


# The hidden-unit view of one expert (the bank's names without the expert axis): fc1's rows (both halves of a
# gated fc1), fc1's bias, the inner norm's entries and fc2's columns are one unit each.

def unit_index(name: str, tensor: torch.Tensor, hidden: int) -> int | None:
    """The axis of `tensor` (one expert's, named as in the bank) along the hidden units, or None (fc2's bias)."""
    if name.startswith(("fc1.", "norm.")):
        return 0
    if name == "fc2.weight":
        return 1
    return None


def permuted(state: dict[str, torch.Tensor], permutation: torch.Tensor, hidden: int) -> dict[str, torch.Tensor]:
    """One expert's tensors with its hidden units in the order `permutation` [H] (unit h takes old unit p[h]);
    a gated fc1's two halves move together."""
    out = {}
    for name, tensor in state.items():
        axis = unit_index(name, tensor, hidden)
        if axis is None:
            out[name] = tensor
            continue
        halves = tensor.shape[axis] // hidden
        index = torch.cat([permutation + half * hidden for half in range(halves)])
        out[name] = tensor.index_select(axis, index)
    return out


def unit_features(state: dict[str, torch.Tensor], hidden: int) -> torch.Tensor:
    """[H, D]: each hidden unit's weights in one row (fc1 rows of each half, fc1 bias, norm entries, fc2
    column), what weight matching lines up."""
    columns = []
    for name, tensor in sorted(state.items()):
        axis = unit_index(name, tensor, hidden)
        if axis is None:
            continue
        moved = tensor.movedim(axis, 0)
        halves = moved.shape[0] // hidden
        for half in range(halves):
            columns.append(moved[half * hidden:(half + 1) * hidden].reshape(hidden, -1).double())
    return torch.cat(columns, dim=1)


def expert_state(bank: nn.Module, expert: int) -> dict[str, torch.Tensor]:
    """Expert `expert` of an `Experts` bank (routed or shared): its tensors (bank names, no expert axis),
    detached, on the CPU."""
    return {name: tensor[expert].detach().cpu() for name, tensor in bank.state_dict().items()
            if tensor.dim() >= 1 and tensor.shape[0] == bank.num_experts and name != "clamp"}

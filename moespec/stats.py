"""Stats: total and activated parameters of a spec, counted from the built model (meta device, no weights).

Activated parameters per routed item (BRIEF.md §7): everything outside the MoE layers, plus each MoE
layer's router, shared experts and `top_k` of its routed experts. Shared tensors count once; buffers never.
FLOP counting is the next stage (see the stats issue); these records are data, rendered by the CLI.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torch import nn

from .backbone import create_backbone
from .compile import create_model, moe_layers
from .spec import Spec


@dataclass(frozen=True)
class LayerStats:
    path: str
    experts: int
    top_k: int
    shared_experts: int
    params: int  # router + shared + all routed experts
    activated_params: int  # router + shared + top_k routed experts
    activated: str = "per token"  # what one routed item is


@dataclass(frozen=True)
class SpecStats:
    name: str
    spec: str  # the spec file, or "" for a spec built in Python
    backbone: str
    input_size: tuple[int, int, int]
    total_params: int
    activated_params: int
    dense_params: int
    moe_layers: int
    experts_total: int
    layers: list[LayerStats] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def count_params(module: nn.Module) -> int:
    """Parameters of `module`, each shared tensor once, buffers not counted."""
    return sum(p.numel() for p in module.parameters())  # parameters() already yields each tensor once


def stats(spec: Spec) -> SpecStats:
    """Parameter counts of `spec`'s MoE model and of its dense backbone (both built on the meta device)."""
    model = create_model(spec, device="meta")
    total = count_params(model)
    layers = []
    for path, moe in moe_layers(model).items():
        routed = count_params(moe.experts)
        other = count_params(moe) - routed  # router + shared experts
        per_expert = routed // moe.num_experts
        shared = moe.shared.num_experts if moe.shared is not None else 0
        layers.append(LayerStats(path, moe.num_experts, moe.top_k, shared, routed + other, other + moe.top_k * per_expert))
    activated = total - sum(layer.params - layer.activated_params for layer in layers)
    dense = count_params(create_backbone(spec, device="meta"))
    return SpecStats(
        name=spec.name or spec.backbone.model,
        spec=spec.source or "",
        backbone=spec.backbone.model,
        input_size=model.moespec_plan.input_size,
        total_params=total,
        activated_params=activated,
        dense_params=dense,
        moe_layers=len(layers),
        experts_total=sum(layer.experts for layer in layers),
        layers=layers,
    )

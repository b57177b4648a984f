"""Router kind `topk`, token choice (Shazeer et al. 2017): every routed item picks its `top_k` experts;
optionally noisy, capacity-limited (with batch prioritized routing) or with importance-score drops."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import Field

from ..spec.fields import NonNegativeFloat
from ..spec.registry import Inspection, RouterKind, RouterSpec, register_router_kind
from .gates import (
    Gate,
    GateField,
    build_gate,
    describe_gate,
    describe_group,
    images_per_group,
    routed_pairs,
    sparse_moe,
)


class TopKRouterSpec(RouterSpec):
    """Token choice: every routed item picks its `top_k` experts (Shazeer et al. 2017)."""

    kind: Literal["topk"] = "topk"
    gate: GateField = Gate()
    normalize: bool = False
    """Renormalize the k selected gate values to sum to 1 (makes an upcycled model exactly dense)."""
    noise: Union[bool, NonNegativeFloat] = False
    """Noisy top-k (training only): `true` adds N(0, (1/E)^2) to the logits; a number sets the std."""
    bpr: bool = False
    """Batch prioritized routing: with a capacity factor, fill capacity by highest gate value, not position."""
    drop_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Importance-score routing (Sparse-MLP): the items with the lowest top-1 gate value, this fraction of
    them, are not dispatched at all."""

    title: ClassVar[str] = "top-k"
    takes_capacity_factor: ClassVar[bool] = True

    def check_group(self, group: Any) -> None:
        if self.bpr and group.capacity_factor is None:
            raise ValueError("router.bpr (batch prioritized routing) needs a capacity_factor; set one, e.g. 1.25, "
                             "or remove bpr")

    def group_cannot_matter(self, group: Any) -> str:
        if group.capacity_factor is None and self.drop_fraction == 0:
            return "dropless top-k without drops routes every item on its own (a capacity_factor or drop_fraction " \
                   "decides within the group)"
        return ""


def build(router: dict, layer: Any, experts, shared):
    from ..layers import TopKRouter  # torch: deferred (routers/__init__)

    noise = 1.0 / layer.experts if router["noise"] is True else float(router["noise"])
    module = TopKRouter(build_gate(router["gate"], layer.in_features, layer.experts), layer.experts, layer.top_k,
                        normalize=router["normalize"], noise_std=noise, capacity_factor=layer.capacity_factor,
                        bpr=router["bpr"], drop_fraction=router["drop_fraction"],
                        group=images_per_group(router["group"]))
    return sparse_moe(module, layer, experts, shared)


def describe(router: dict, layer: Any) -> str:
    extras = [("norm", router["normalize"]), ("noise", bool(router["noise"])), ("bpr", router["bpr"]),
              (f"drop={router['drop_fraction']:g}", router["drop_fraction"] > 0),
              (f"cf={layer.capacity_factor}", layer.capacity_factor is not None),
              (describe_group(router), layer.capacity_factor is not None or router["drop_fraction"] > 0)]
    return " ".join([describe_gate("topk", router)] + [label for label, on in extras if on])


def caveats(router: dict, layer: Any) -> list[str]:
    found = []
    if not router["normalize"] and layer.top_k < layer.experts:
        found.append(f"the top-{layer.top_k} gates are not renormalized (normalize: false), so the FFN output is "
                     f"scaled by the kept gate mass")
    if layer.capacity_factor is not None or router["drop_fraction"] > 0:
        found.append("tokens dropped by the capacity factor or importance-score routing get no FFN output")
    return found


TOPK = register_router_kind(RouterKind(
    spec=TopKRouterSpec, build=build, describe=describe, caveats=caveats,
    activated=lambda router, layer: (layer.top_k, "per token"),
    inspect=Inspection(unit="token", name=lambda top_k: f"top-{top_k}",
                       share_label="share of the class's tokens\nsent to the expert", tally=routed_pairs),
))

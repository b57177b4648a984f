"""Router kind `expert_choice` (Zhou et al. 2022): each expert takes its top C = round(c * T / E) items; an
item may be taken by several experts or by none."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from ..spec.fields import PositiveFloat
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


class ExpertChoiceRouterSpec(RouterSpec):
    """Expert choice (Zhou et al. 2022): each expert takes its top C = capacity * T / E items."""

    kind: Literal["expert_choice"]
    gate: GateField = Gate()
    capacity: PositiveFloat = 1.0
    """c: on average each item is processed by c experts."""

    title: ClassVar[str] = "expert choice"
    takes_top_k: ClassVar[bool] = False
    instead: ClassVar[str] = "set router.capacity"


def build(router: dict, layer: Any, experts, shared):
    from ..layers import ExpertChoiceRouter  # torch: deferred (routers/__init__)

    gate = build_gate(router["gate"], layer.in_features, layer.experts)
    module = ExpertChoiceRouter(gate, layer.experts, capacity=router["capacity"],
                                group=images_per_group(router["group"]))
    return sparse_moe(module, layer, experts, shared)


EXPERT_CHOICE = register_router_kind(RouterKind(
    spec=ExpertChoiceRouterSpec, build=build,
    describe=lambda router, layer: f"{describe_gate('expert_choice', router)} c={router['capacity']:g} "
                                   f"{describe_group(router)}",
    caveats=lambda router, layer: ["with expert choice a token may be taken by several experts or by none"],
    activated=lambda router, layer: (router["capacity"], f"per token, on average (c = {router['capacity']:g} experts)"),
    inspect=Inspection(unit="token", name=lambda top_k: "expert choice",
                       share_label="share of the class's tokens\nsent to the expert", tally=routed_pairs),
))

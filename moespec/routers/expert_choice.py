"""Router kind `expert_choice` (Zhou et al. 2022): each expert takes its top C = round(c * T / E) items; an
item may be taken by several experts or by none."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from ..spec.fields import FloatRange
from ..spec.registry import RouterSpec, register_router_kind
from .gates import (
    MAX_CAPACITY_FACTOR,
    TOKENS,
    Gate,
    GateField,
    RoutingGroup,
    build_gate,
    describe_gate,
    describe_group,
    images_per_group,
    sparse_moe,
)


@register_router_kind
class ExpertChoiceRouterSpec(RouterSpec):
    """Expert choice (Zhou et al. 2022): each expert takes its top C = capacity * T / E items."""

    kind: Literal["expert_choice"]
    group: RoutingGroup = None
    gate: GateField = Gate()
    capacity: FloatRange(0.0, MAX_CAPACITY_FACTOR, low_open=True) = 1.0
    """c: on average each item is processed by c experts."""

    title: ClassVar[str] = "expert choice"
    fixed_experts: ClassVar[str] = (
        "each expert picks its own C = c*T/E items, so no item chooses an expert: removing or merging one changes "
        "what every other expert picks")
    inspection: ClassVar = TOKENS

    def activated_unit(self) -> str:
        return f"per token, on average (c = {self.capacity:g} experts)"

    def build(self, layer: Any, experts: Any, shared: Any) -> Any:
        from ..layers import ExpertChoiceRouter  # torch: deferred (routers/__init__)

        gate = build_gate(self.gate, layer.in_features, layer.num_experts)
        module = ExpertChoiceRouter(gate, layer.num_experts, capacity=self.capacity,
                                    group=images_per_group(self.group))
        return sparse_moe(module, layer, experts, shared)

    def describe(self, layer: Any) -> str:
        return f"{describe_gate('expert_choice', self.gate)} c={self.capacity:g} {describe_group(self.group)}"

    def caveats(self, layer: Any) -> list[str]:
        return ["with expert choice a token may be taken by several experts or by none"]

"""Router kind `topk`, token choice (Shazeer et al. 2017): every routed item picks its `top_k` experts;
optionally noisy, capacity-limited (with batch prioritized routing) or with importance-score drops."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import Field, model_validator

from ..spec.fields import FloatRange, IntRange
from ..spec.models import MAX_EXPERTS, MAX_NOISE_STD
from ..spec.registry import FieldError, RouterSpec, register_router_kind
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
class TopKRouterSpec(RouterSpec):
    """Token choice: every routed item picks its `top_k` experts (Shazeer et al. 2017)."""

    kind: Literal["topk"] = "topk"
    top_k: IntRange(1, MAX_EXPERTS) = 1
    """Experts per item k, 1 <= k <= experts."""
    capacity_factor: Optional[FloatRange(0.0, MAX_CAPACITY_FACTOR, low_open=True)] = None
    """Each expert takes at most ceil(capacity_factor * top_k * T / experts) of T items; null = dropless."""
    group: RoutingGroup = None
    gate: GateField = Gate()
    normalize: bool = False
    """Renormalize the k selected gate values to sum to 1 (makes an upcycled model exactly dense)."""
    noise: Union[bool, FloatRange(0.0, MAX_NOISE_STD)] = False
    """Noisy top-k (training only): `true` adds N(0, (1/E)^2) to the logits; a number sets the std."""
    bpr: bool = False
    """Batch prioritized routing: with a capacity factor, fill capacity by highest gate value, not position."""
    drop_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Importance-score routing (Sparse-MLP): the items with the lowest top-1 gate value, this fraction of
    them, are not dispatched at all."""

    title: ClassVar[str] = "top-k"
    inspection: ClassVar = TOKENS

    @model_validator(mode="after")
    def _settings_fit(self) -> "TopKRouterSpec":
        if self.bpr and self.capacity_factor is None:
            raise FieldError("bpr", "bpr (batch prioritized routing) needs a capacity_factor; set one, e.g. 1.25, "
                                    "or remove bpr")
        if self.group is not None and self.capacity_factor is None and self.drop_fraction == 0:
            raise FieldError("group", "group cannot matter here: dropless top-k without drops routes every item on its "
                                      "own (a capacity_factor or drop_fraction decides within the group); remove it")
        return self

    def check_experts(self, num_experts: int) -> None:
        if self.top_k > num_experts:
            raise FieldError("top_k", f"top_k ({self.top_k}) must be between 1 and experts ({num_experts})")

    def build(self, layer: Any, experts: Any, shared: Any) -> Any:
        from ..layers import TopKRouter  # torch: deferred (routers/__init__)

        noise = 1.0 / layer.num_experts if self.noise is True else float(self.noise)
        module = TopKRouter(build_gate(self.gate, layer.in_features, layer.num_experts), layer.num_experts,
                            self.top_k, normalize=self.normalize, noise_std=noise,
                            capacity_factor=self.capacity_factor, bpr=self.bpr, drop_fraction=self.drop_fraction,
                            group=images_per_group(self.group))
        return sparse_moe(module, layer, experts, shared)

    def describe(self, layer: Any) -> str:
        capacity = self.capacity_factor is not None
        extras = [("norm", self.normalize), ("noise", bool(self.noise)), ("bpr", self.bpr),
                  (f"drop={self.drop_fraction:g}", self.drop_fraction > 0),
                  (f"cf={self.capacity_factor}", capacity),
                  (describe_group(self.group), capacity or self.drop_fraction > 0)]
        return " ".join([describe_gate("topk", self.gate)] + [label for label, on in extras if on])

    def picks(self) -> int:
        return self.top_k

    def report_name(self) -> str:
        return f"top-{self.top_k}"

    def caveats(self, layer: Any) -> list[str]:
        found = []
        if not self.normalize and self.top_k < layer.num_experts:
            found.append(f"the top-{self.top_k} gates are not renormalized (normalize: false), so the FFN output is "
                         f"scaled by the kept gate mass")
        if self.capacity_factor is not None or self.drop_fraction > 0:
            found.append("tokens dropped by the capacity factor or importance-score routing get no FFN output")
        return found

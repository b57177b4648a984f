"""Router kind `topk`, token choice (Shazeer et al. 2017): every routed item picks its `top_k` experts;
optionally noisy, capacity-limited (with batch prioritized routing) or with importance-score drops."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import Field, model_validator

from ..spec.fields import FloatRange, IntRange
from ..spec.models import MAX_NOISE_STD
from ..spec.registry import FieldError, register_router_kind
from .choice import ChoiceRouterSpec
from .gates import (
    MAX_CAPACITY_FACTOR,
    TOKENS,
    RoutingGroup,
    build_gate,
    describe_gate,
    describe_group,
    images_per_group,
    sparse_moe,
)

CapacityFactor = FloatRange(0.0, MAX_CAPACITY_FACTOR, low_open=True)
MAX_CAPACITY_MULTIPLE = 1_024
"""`capacity_multiple`: V-MoE rounds to 4 (vmoe's `_compute_capacity`); 1,024 is already more than a layer's
capacity in most groups."""


@register_router_kind
class TopKRouterSpec(ChoiceRouterSpec):
    """Token choice: every routed item picks its `top_k` experts (Shazeer et al. 2017)."""

    kind: Literal["topk"] = "topk"
    capacity_factor: Optional[CapacityFactor] = None
    """Each expert takes at most ceil(capacity_factor * top_k * T / experts) of T items; null = dropless."""
    capacity_multiple: IntRange(1, MAX_CAPACITY_MULTIPLE) = 1
    """Each expert's capacity per routing group, ceil(capacity_factor * top_k * T / experts), rounded up to a
    multiple of this: V-MoE's routers round to 4 (`capacity_multiple: 4`); 1: no rounding."""
    group: RoutingGroup = None
    noise: Union[bool, FloatRange(0.0, MAX_NOISE_STD)] = False
    """Noisy top-k (training only): `true` adds N(0, (1/E)^2) to the logits; a number sets the std."""
    bpr: bool = False
    """Batch prioritized routing: with a capacity factor, fill capacity by highest gate value, not position."""
    drop_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Importance-score routing (Sparse-MLP): the items with the lowest top-1 gate value, this fraction of
    them, are not dispatched at all."""
    eval_capacity_factor: Optional[Union[CapacityFactor, Literal["dropless"]]] = None
    """The capacity factor in eval mode (DeepSpeed's eval_capacity_factor), or `dropless`; default:
    capacity_factor."""

    title: ClassVar[str] = "top-k"
    inspection: ClassVar = TOKENS

    @model_validator(mode="after")
    def _settings_fit(self) -> "TopKRouterSpec":
        capacity = self.capacity_factor is not None or isinstance(self.eval_capacity_factor, float)
        if self.bpr and not capacity:
            raise FieldError("bpr", "bpr (batch prioritized routing) needs a capacity_factor; set one, e.g. 1.25, "
                                    "or remove bpr")
        if self.group is not None and not capacity and self.drop_fraction == 0:
            raise FieldError("group", "group cannot matter here: dropless top-k without drops routes every item on its "
                                      "own (a capacity_factor or drop_fraction decides within the group); remove it")
        if self.capacity_multiple > 1 and not capacity:
            raise FieldError("capacity_multiple", "capacity_multiple rounds a capacity, and this router is dropless; "
                                                  "set a capacity_factor or remove capacity_multiple")
        if self.eval_capacity_factor == "dropless" and self.capacity_factor is None:
            raise FieldError("eval_capacity_factor", "the router is dropless already (capacity_factor: null); remove "
                                                     "eval_capacity_factor")
        return self

    def eval_capacity(self) -> float | None:
        """The capacity factor in eval mode (None: dropless)."""
        if self.eval_capacity_factor is None:
            return self.capacity_factor
        return None if self.eval_capacity_factor == "dropless" else self.eval_capacity_factor

    def build(self, layer: Any, experts: Any, shared: Any) -> Any:
        from ..layers import TopKRouter  # torch: deferred (routers/__init__)

        noise = 1.0 / layer.num_experts if self.noise is True else float(self.noise)
        eval_capacity = "training" if self.eval_capacity_factor is None else self.eval_capacity()
        module = TopKRouter(build_gate(self.gate, layer.in_features, layer.num_experts), layer.num_experts,
                            self.top_k, noise_std=noise, capacity_factor=self.capacity_factor, bpr=self.bpr,
                            drop_fraction=self.drop_fraction, group=images_per_group(self.group),
                            eval_capacity_factor=eval_capacity, capacity_multiple=self.capacity_multiple,
                            **self.choice_options())
        return sparse_moe(module, layer, experts, shared)

    def describe(self, layer: Any) -> str:
        capacity = self.capacity_factor is not None or isinstance(self.eval_capacity_factor, float)
        extras = self.choice_labels() + [
            ("noise", bool(self.noise)), ("bpr", self.bpr), (f"drop={self.drop_fraction:g}", self.drop_fraction > 0),
            (f"cf={self.capacity_factor}", self.capacity_factor is not None),
            (f"capacity-multiple={self.capacity_multiple}", self.capacity_multiple > 1),
            (f"eval-cf={self.eval_capacity() or 'dropless'}", self.eval_capacity() != self.capacity_factor),
            (describe_group(self.group), capacity or self.drop_fraction > 0)]
        return " ".join([describe_gate("topk", self.gate)] + [label for label, on in extras if on])

    def report_name(self) -> str:
        return f"top-{self.top_k}"

    def caveats(self, layer: Any) -> list[str]:
        found = super().caveats(layer)
        if self.capacity_factor is not None or self.drop_fraction > 0:
            found.append("tokens dropped by the capacity factor or importance-score routing get no FFN output")
        return found

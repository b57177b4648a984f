"""Router kind `image`, image-level routing (ViMoE): one gate decision per image, from its [CLS] token or its
mean token, shared by all the image's tokens."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from ..errors import Problem, SpecError
from ..spec.fields import FloatRange, IntRange
from ..spec.models import MAX_EXPERTS
from ..spec.registry import Inspection, RouterSpec, register_router_kind
from .gates import (
    MAX_ROUTE_SCALE,
    BiasBalance,
    ExpertGroups,
    Gate,
    GateField,
    build_gate,
    check_choice,
    choice_caveats,
    describe_choice,
    describe_gate,
    expert_groups,
    routed_pairs,
    sparse_moe,
)


@register_router_kind
class ImageRouterSpec(RouterSpec):
    """Image-level routing (ViMoE): one gate decision per image, from its [CLS] token or mean token."""

    kind: Literal["image"]
    top_k: IntRange(1, MAX_EXPERTS) = 1
    """Experts per image k, 1 <= k <= experts."""
    gate: GateField = Gate()
    normalize: bool = False
    pool: Optional[Literal["cls", "mean"]] = None
    """Which vector the gate reads; default: `cls` where the model has a [CLS] token, else `mean`."""
    score: Literal["softmax", "sigmoid"] = "softmax"
    """As top-k's: `sigmoid` scores (DeepSeek-V3) are renormalized over the k chosen."""
    scale: FloatRange(0.0, MAX_ROUTE_SCALE, low_open=True) = 1.0
    """Multiplies the combine weights."""
    bias_balance: Optional[BiasBalance] = None
    """Auxiliary-loss-free load balancing (DeepSeek-V3), over images."""
    groups: Optional[ExpertGroups] = None
    """Group-limited top-k (DeepSeek-V3): `{count: G, top: g}`."""
    eval_top_k: Optional[IntRange(1, MAX_EXPERTS)] = None
    """k in eval mode; default: top_k."""

    title: ClassVar[str] = "image-level top-k"
    inspection: ClassVar = Inspection(unit="image", share_label="share of the class's images\nsent to the expert",
                                      tally=routed_pairs)

    def resolve(self, sketch: Any, model: str) -> "ImageRouterSpec":
        """`pool` defaults to the [CLS] token where the model has one (timm ViTs put it first in the sequence)."""
        pool = self.pool or ("cls" if sketch.has_cls_token else "mean")
        if pool == "cls" and not sketch.has_cls_token:
            raise SpecError(Problem(f"{model} has no [CLS] token; use pool: mean", path="pool"))
        return self.model_copy(update={"pool": pool})

    def check_experts(self, num_experts: int) -> None:
        check_choice(self, num_experts)

    def build(self, layer: Any, experts: Any, shared: Any) -> Any:
        from ..layers import ImageRouter  # torch: deferred (routers/__init__)

        gate = build_gate(self.gate, layer.in_features, layer.num_experts)
        module = ImageRouter(gate, layer.num_experts, self.top_k, normalize=self.normalize, pool=self.pool,
                             score=self.score, scale=self.scale,
                             bias_rate=self.bias_balance.rate if self.bias_balance is not None else None,
                             expert_groups=expert_groups(self.groups), eval_top_k=self.eval_top_k)
        return sparse_moe(module, layer, experts, shared)

    def describe(self, layer: Any) -> str:
        labels = [label for label, on in describe_choice(self) if on]
        return " ".join([describe_gate(f"image/{self.pool}", self.gate)] + labels)

    def activated_unit(self) -> str:
        return "per image"

    def picks(self) -> int:
        return self.top_k

    def eval_picks(self) -> int:
        return self.eval_top_k or self.top_k

    def report_name(self) -> str:
        return f"image-level top-{self.top_k}"

    def caveats(self, layer: Any) -> list[str]:
        return choice_caveats(self, layer.num_experts)

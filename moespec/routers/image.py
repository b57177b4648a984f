"""Router kind `image`, image-level routing (ViMoE): one gate decision per image, from its [CLS] token or its
mean token, shared by all the image's tokens."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from ..errors import Problem, SpecError
from ..spec.fields import IntRange
from ..spec.models import MAX_EXPERTS
from ..spec.registry import FieldError, Inspection, RouterSpec, register_router_kind
from .gates import Gate, GateField, build_gate, routed_pairs, sparse_moe


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
        if self.top_k > num_experts:
            raise FieldError("top_k", f"top_k ({self.top_k}) must be between 1 and experts ({num_experts})")

    def build(self, layer: Any, experts: Any, shared: Any) -> Any:
        from ..layers import ImageRouter  # torch: deferred (routers/__init__)

        gate = build_gate(self.gate, layer.in_features, layer.num_experts)
        module = ImageRouter(gate, layer.num_experts, self.top_k, normalize=self.normalize, pool=self.pool)
        return sparse_moe(module, layer, experts, shared)

    def describe(self, layer: Any) -> str:
        return f"image/{self.pool}/{self.gate.kind}" + (" norm" if self.normalize else "")

    def activated_unit(self) -> str:
        return "per image"

    def picks(self) -> int:
        return self.top_k

    def report_name(self) -> str:
        return f"image-level top-{self.top_k}"

    def caveats(self, layer: Any) -> list[str]:
        if self.normalize or self.top_k >= layer.num_experts:
            return []
        return [f"the top-{self.top_k} gates are not renormalized (normalize: false), so the FFN output is scaled by "
                f"the kept gate mass"]

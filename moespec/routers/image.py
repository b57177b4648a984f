"""Router kind `image`, image-level routing (ViMoE): one gate decision per image, from its [CLS] token or its
mean token, shared by all the image's tokens."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from ..errors import Problem, SpecError
from ..spec.registry import Inspection, register_router_kind
from .choice import ChoiceRouterSpec
from .gates import build_gate, describe_gate, routed_pairs, sparse_moe


@register_router_kind
class ImageRouterSpec(ChoiceRouterSpec):
    """Image-level routing (ViMoE): one gate decision per image, from its [CLS] token or mean token; `top_k` and
    DeepSeek-V3's options act per image."""

    kind: Literal["image"]
    pool: Optional[Literal["cls", "mean"]] = None
    """Which vector the gate reads; default: `cls` where the model has a [CLS] token, else `mean`."""

    title: ClassVar[str] = "image-level top-k"
    whole_images: ClassVar[bool] = True
    inspection: ClassVar = Inspection(unit="image", share_label="share of the class's images\nsent to the expert",
                                      tally=routed_pairs)

    def resolve(self, sketch: Any, model: str) -> "ImageRouterSpec":
        """`pool` defaults to the [CLS] token where the model has one (timm ViTs put it first in the sequence)."""
        pool = self.pool or ("cls" if sketch.has_cls_token else "mean")
        if pool == "cls" and not sketch.has_cls_token:
            raise SpecError(Problem(f"{model} has no [CLS] token; use pool: mean", path="pool"))
        return self.model_copy(update={"pool": pool})

    def build(self, layer: Any, experts: Any, shared: Any) -> Any:
        from ..layers import ImageRouter  # torch: deferred (routers/__init__)

        gate = build_gate(self.gate, layer.in_features, layer.num_experts)
        module = ImageRouter(gate, layer.num_experts, self.top_k, pool=self.pool, **self.choice_options())
        if layer.whole_ffn:  # experts are whole copies of an FFN that mixes positions
            from ..layers import ImageFFNMoE

            return ImageFFNMoE(module, experts, shared, out_features=layer.out_features,
                               channels_dim=layer.channels_dim, aux_loss_weights=dict(layer.aux_loss_weights),
                               aux_loss_in_backward=layer.aux_loss_in_backward,
                               aux_loss_backward_scale=layer.aux_loss_backward_scale)
        return sparse_moe(module, layer, experts, shared)

    def describe(self, layer: Any) -> str:
        labels = [label for label, on in self.choice_labels() if on]
        return " ".join([describe_gate(f"image/{self.pool}", self.gate)] + labels)

    def activated_unit(self) -> str:
        return "per image"

    def report_name(self) -> str:
        return f"image-level top-{self.top_k}"

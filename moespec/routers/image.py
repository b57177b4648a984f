"""Router kind `image`, image-level routing (ViMoE): one gate decision per image, from its [CLS] token or its
mean token, shared by all the image's tokens."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from ..errors import Problem, SpecError
from ..spec.registry import Inspection, RouterKind, RouterSpec, register_router_kind
from .gates import Gate, GateField, build_gate, routed_pairs, sparse_moe


class ImageRouterSpec(RouterSpec):
    """Image-level routing (ViMoE): one gate decision per image, from its [CLS] token or mean token."""

    kind: Literal["image"]
    gate: GateField = Gate()
    normalize: bool = False
    pool: Optional[Literal["cls", "mean"]] = None
    """Which vector the gate reads; default: `cls` where the model has a [CLS] token, else `mean`."""

    title: ClassVar[str] = "image-level top-k"

    def group_cannot_matter(self, group: Any) -> str:
        return "image routing decides for each image on its own, from that image's vector"


def resolve(router: dict, sketch: Any, name: str) -> dict:
    """`pool` defaults to the [CLS] token where the model has one (timm ViTs put it first in the sequence)."""
    has_cls = sketch.has_cls_token
    pool = router["pool"] or ("cls" if has_cls else "mean")
    if pool == "cls" and not has_cls:
        raise SpecError(Problem(f"{name} has no [CLS] token; use pool: mean", path="pool"))
    return {**router, "pool": pool}


def build(router: dict, layer: Any, experts, shared):
    from ..layers import ImageRouter  # torch: deferred (routers/__init__)

    gate = build_gate(router["gate"], layer.in_features, layer.experts)
    module = ImageRouter(gate, layer.experts, layer.top_k, normalize=router["normalize"], pool=router["pool"])
    return sparse_moe(module, layer, experts, shared)


def caveats(router: dict, layer: Any) -> list[str]:
    if router["normalize"] or layer.top_k >= layer.experts:
        return []
    return [f"the top-{layer.top_k} gates are not renormalized (normalize: false), so the FFN output is scaled by "
            f"the kept gate mass"]


IMAGE = register_router_kind(RouterKind(
    spec=ImageRouterSpec, build=build, resolve=resolve, caveats=caveats,
    describe=lambda router, layer: (f"image/{router['pool']}/{router['gate']['kind']}"
                                    + (" norm" if router["normalize"] else "")),
    activated=lambda router, layer: (layer.top_k, "per image"),
    inspect=Inspection(unit="image", name=lambda top_k: f"image-level top-{top_k}",
                       share_label="share of the class's images\nsent to the expert", tally=routed_pairs),
))

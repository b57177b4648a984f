"""Router kind `soft`, Soft MoE (Puigcerver et al. 2024): every slot is a convex combination of all the tokens
of a sequence, every output token a convex combination of all slots. Nothing is dropped, nothing balanced."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from ..spec.fields import IntRange
from ..spec.registry import Inspection, RouterKind, RouterSpec, register_router_kind

if TYPE_CHECKING:  # torch and the layers are imported where used (see routers/__init__)
    import torch

    from ..layers import SoftMoE

MAX_SLOTS_PER_EXPERT = 65_536
"""Soft MoE slots per expert: a single expert with one slot per token of a 4,096 px image in 16 px patches;
Puigcerver et al. (2024) use 1 or 2."""


class SoftRouterSpec(RouterSpec):
    """Soft MoE (Puigcerver et al. 2024): every slot is a convex combination of all tokens of a sequence."""

    kind: Literal["soft"]
    slots_per_expert: IntRange(1, MAX_SLOTS_PER_EXPERT) = 1

    title: ClassVar[str] = "Soft MoE"
    takes_top_k: ClassVar[bool] = False
    load_balanced: ClassVar[bool] = False

    def group_cannot_matter(self, group: Any) -> str:
        return "Soft MoE mixes the tokens of each image only, with no capacity to share"


def build(router: dict, layer: Any, experts, shared):
    from ..layers import SoftMoE  # torch: deferred (routers/__init__)

    return SoftMoE(experts, router["slots_per_expert"], shared, channels_dim=layer.channels_dim)


def combine_mass(moe: SoftMoE) -> tuple[torch.Tensor, float]:
    """Inspection: [B, E] combine weight mass of each expert's slots per image (how much of the image's token
    outputs comes from the expert; the dispatch weights cannot show it, each slot's sum to 1 over an image).
    Nothing is dropped."""
    combine = moe.last_combine.detach().double()  # [B, N, S]
    return combine.reshape(*combine.shape[:2], moe.num_experts, -1).sum(dim=(1, 3)), 0.0


SOFT = register_router_kind(RouterKind(
    spec=SoftRouterSpec, build=build,
    describe=lambda router, layer: f"soft p={router['slots_per_expert']}",
    caveats=lambda router, layer: ["Soft MoE feeds experts convex mixtures of all tokens, not each token itself"],
    activated=lambda router, layer: (layer.experts, "per sequence (every slot sees every token)"),
    inspect=Inspection(unit="token", name=lambda top_k: "Soft MoE",
                       share_label="share of the class's token outputs\n(combine weight mass)", tally=combine_mass),
))

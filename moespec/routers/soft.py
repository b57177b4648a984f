"""Router kind `soft`, Soft MoE (Puigcerver et al. 2024): every slot is a convex combination of all the tokens
of a sequence, every output token a convex combination of all slots. Nothing is dropped, nothing balanced."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from ..spec.fields import IntRange
from ..spec.registry import Inspection, RouterSpec, register_router_kind

if TYPE_CHECKING:  # torch and the layers are imported where used (see routers/__init__)
    import torch

    from ..layers import SoftMoE

MAX_SLOTS_PER_EXPERT = 65_536
"""Soft MoE slots per expert: a single expert with one slot per token of a 4,096 px image in 16 px patches;
Puigcerver et al. (2024) use 1 or 2."""


def combine_mass(moe: SoftMoE) -> tuple[torch.Tensor, float]:
    """Inspection: [B, E] combine weight mass of each expert's slots per image (how much of the image's token
    outputs comes from the expert; the dispatch weights cannot show it, each slot's sum to 1 over an image).
    Nothing is dropped."""
    combine = moe.last_combine.detach().double()  # [B, N, S]
    return combine.reshape(*combine.shape[:2], moe.num_experts, -1).sum(dim=(1, 3)), 0.0


@register_router_kind
class SoftRouterSpec(RouterSpec):
    """Soft MoE (Puigcerver et al. 2024): every slot is a convex combination of all tokens of a sequence."""

    kind: Literal["soft"]
    slots_per_expert: IntRange(1, MAX_SLOTS_PER_EXPERT) = 1

    title: ClassVar[str] = "Soft MoE"
    load_balanced: ClassVar[bool] = False
    inspection: ClassVar = Inspection(unit="token", share_label="share of the class's token outputs\n(combine weight "
                                      "mass)", tally=combine_mass)

    def build(self, layer: Any, experts: Any, shared: Any) -> Any:
        from ..layers import SoftMoE  # torch: deferred (routers/__init__)

        return SoftMoE(experts, self.slots_per_expert, shared, channels_dim=layer.channels_dim)

    def describe(self, layer: Any) -> str:
        return f"soft p={self.slots_per_expert}"

    def activated_unit(self) -> str:
        return "per sequence (every slot sees every token)"

    def caveats(self, layer: Any) -> list[str]:
        return ["Soft MoE feeds experts convex mixtures of all tokens, not each token itself"]

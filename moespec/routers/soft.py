"""Router kind `soft`, Soft MoE (Puigcerver et al. 2024): every slot is a convex combination of all the tokens
of a sequence, every output token a convex combination of all slots. Nothing is dropped, nothing balanced."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import model_validator

from ..spec.fields import IntRange
from ..spec.registry import FieldError, Inspection, RouterSpec, register_router_kind

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
    dispatch: Literal["soft", "uniform", "identity"] = "soft"
    """How slots mix tokens: `soft` (learned, softmax over tokens), `uniform` (every slot is the mean token) or
    `identity` (slot i is token i; needs experts x slots_per_expert = tokens). The ablations of Puigcerver et
    al. (2024), Table 2."""
    combine: Literal["soft", "uniform", "identity"] = "soft"
    """How output tokens mix slot outputs: `soft` (learned, softmax over slots), `uniform` (the mean slot output)
    or `identity` (token i gets slot i's output); default `soft`, and `identity` with `dispatch: identity` (the
    paper's Identity row)."""

    @model_validator(mode="before")
    @classmethod
    def _identity_combines_by_identity(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("dispatch") == "identity" and "combine" not in data:
            data = {**data, "combine": "identity"}
        return data

    title: ClassVar[str] = "Soft MoE"
    fixed_experts: ClassVar[str] = (
        "every expert's slots mix all the tokens (no token chooses an expert), and the slots are sized by the experts")
    rows_per_expert: ClassVar[bool] = False  # slots, not one gate row per expert
    load_balanced: ClassVar[bool] = False
    inspection: ClassVar = Inspection(unit="token", share_label="share of the class's token outputs\n(combine weight "
                                      "mass)", tally=combine_mass)

    def check_items(self, layer: Any, items_per_image: int) -> None:
        slots = layer.num_experts * self.slots_per_expert
        if "identity" in (self.dispatch, self.combine) and slots != items_per_image:
            field = "dispatch" if self.dispatch == "identity" else "combine"
            raise FieldError(field, f"{layer.path}: identity routing sends token i to slot i, so it needs one slot "
                                    f"per token: {items_per_image} tokens per image, but experts x slots_per_expert "
                                    f"= {layer.num_experts} x {self.slots_per_expert} = {slots}")

    def build(self, layer: Any, experts: Any, shared: Any) -> Any:
        from ..layers import SoftMoE  # torch: deferred (routers/__init__)

        layer_name = {"soft": "learned"}  # the layer calls the learned weights what they are
        return SoftMoE(experts, self.slots_per_expert, shared, channels_dim=layer.channels_dim,
                       dispatch=layer_name.get(self.dispatch, self.dispatch),
                       combine=layer_name.get(self.combine, self.combine))

    def describe(self, layer: Any) -> str:
        routing = (self.dispatch, self.combine)
        return f"soft p={self.slots_per_expert}" + ("" if routing == ("soft", "soft") else
                                                     f" dispatch={self.dispatch} combine={self.combine}")

    def activated_unit(self) -> str:
        return "per sequence (every slot sees every token)"

    def caveats(self, layer: Any) -> list[str]:
        if (self.dispatch, self.combine) == ("identity", "identity"):
            return ["identity routing sends each token through its own slot's expert: a different expert per token"]
        return ["Soft MoE feeds experts convex mixtures of all tokens, not each token itself"]

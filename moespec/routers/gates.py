"""What the routers with a gate share: the `gate:` spec, its module, and the sparse MoE layer around them.

`linear`: logits = W_g x (a 1x1 conv on feature maps). `cosine` / `l2`: project x to a low dimension and
compare with learned per-expert codes (X-MoE, Chi et al. 2022).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional, Union

from pydantic import BeforeValidator, Field, model_validator

from ..spec.fields import FloatRange, IntRange, SpecModel
from ..spec.models import MAX_EXPERTS
from ..spec.registry import Inspection

if TYPE_CHECKING:  # torch and the layers are imported where used (see routers/__init__)
    from torch import nn

    from ..layers import Experts, MoE

DEFAULT_GATE_DIM, DEFAULT_TEMPERATURE = 16, 0.07  # cosine / l2 gates (X-MoE, Chi et al. 2022)
LEARNABLE_TEMPERATURE_INIT = 0.5
"""`temperature: learnable` starts here: Swin-MoE's (Hwang et al. 2023) through Tutel's `CosineTopKGate(init_t=0.5)`
(microsoft/tutel, `tutel/gates/cosine_top.py`), whose clamp keeps it at 0.01 or more (`layers.routers`)."""
MAX_GROUP_IMAGES = 1_048_576
"""Images per routing group (2**20): more than any batch; V-MoE groups a device's batch (Riquelme et al. 2021)."""
MAX_GATE_DIM = 65_536
"""A cosine / l2 gate's projection width: X-MoE uses 16; 65,536 is wider than any backbone's items."""
TEMPERATURES = (1e-3, 1e3)
"""A cosine / l2 gate's temperature: X-MoE's 0.07 / 70 and x 14,000. Logits are similarities divided by it, so a
smaller one makes them overflow (to inf, then NaN in the softmax); a larger one makes every gate equal."""
MAX_CAPACITY_FACTOR = float(MAX_EXPERTS)
"""A capacity factor (top-k) or capacity (expert choice): a factor of experts / top_k already lets every expert
take every item, and no layer has more than `MAX_EXPERTS` experts; Switch uses 1.25 (Fedus et al. 2022), expert
choice 1 or 2 (Zhou et al. 2022)."""


class Gate(SpecModel):
    """How router logits are computed from an item (Shazeer et al. 2017; X-MoE, Chi et al. 2022).

    `linear`: `W_g x` (a 1x1 conv on feature maps). `cosine`: project x to `dim`, cosine similarity with
    learned per-expert codes, divided by `temperature` (Chi et al. 2022). `l2`: the same with the negative L2
    distance.
    """

    kind: Literal["linear", "cosine", "l2"] = "linear"
    dim: Optional[IntRange(1, MAX_GATE_DIM)] = None
    """Projection width of cosine / l2 gates; default 16 (X-MoE)."""
    temperature: Optional[Union[FloatRange(*TEMPERATURES), Literal["learnable"]]] = None
    """Divides cosine / l2 logits; default 0.07. `learnable`: a learned temperature, as in Swin-MoE (Hwang et al.
    2023, Tutel's cosine gate): it starts at 0.5 and never falls below 0.01."""

    @model_validator(mode="after")
    def _projection_only_for_cosine_l2(self) -> "Gate":
        if self.kind == "linear" and (self.dim is not None or self.temperature is not None):
            raise ValueError("dim and temperature apply to cosine and l2 gates only; remove them or use kind: cosine "
                             "or l2")
        return self


def _gate_shorthand(value: Any) -> Any:
    """`gate: cosine` is short for `gate: {kind: cosine}`."""
    return {"kind": value} if isinstance(value, str) else value


GateField = Annotated[Gate, BeforeValidator(_gate_shorthand,
                                            json_schema_input_type=Union[Literal["linear", "cosine", "l2"], Gate])]
"""A `gate:` field: a Gate mapping, or just its kind."""


RoutingGroup = Annotated[
    Optional[Union[Literal["image", "batch"], IntRange(1, MAX_GROUP_IMAGES)]],
    Field(description="The routing group, within which capacity, priority and drops are decided: `image` (the "
                      "default) routes\neach image alone, so its prediction does not depend on the rest of its batch; "
                      "N, groups of N consecutive\nimages (V-MoE's group_size); `batch`, the whole batch."),
]
"""A router's `group:` field (the kinds whose decisions couple items: top-k with a capacity or drops, expert
choice)."""


def images_per_group(group: str | int | None) -> int | None:
    """A router's `group` as the layer takes it: images per routing group, None for the whole batch."""
    return 1 if group in (None, "image") else None if group == "batch" else int(group)


def describe_group(group: str | int | None) -> str:
    return f"group={group or 'image'}"


def build_gate(gate: Gate, dim: int, num_experts: int) -> nn.Module:
    """The gate module of a `gate:` spec (linear, cosine or l2) over items of width `dim`."""
    from ..layers import LinearGate, ProjectedGate  # torch: deferred (routers/__init__)

    if gate.kind == "linear":
        return LinearGate(dim, num_experts)
    learnable = gate.temperature == "learnable"
    temperature = LEARNABLE_TEMPERATURE_INIT if learnable else gate.temperature or DEFAULT_TEMPERATURE
    return ProjectedGate(dim, num_experts, proj_dim=gate.dim or DEFAULT_GATE_DIM, temperature=temperature,
                         metric=gate.kind, learnable_temperature=learnable)


def describe_gate(kind: str, gate: Gate) -> str:
    """`topk/linear`, `image/cls/cosine`, `topk/cosine(t=learnable)`: the kind and the gate, the start of a
    plan's router column."""
    return f"{kind}/{gate.kind}" + ("(t=learnable)" if gate.temperature == "learnable" else "")


def sparse_moe(router: nn.Module, layer: Any, experts: Experts, shared: Experts | None) -> MoE:
    """The sparse MoE layer of a `planning.LayerPlan` around a router module."""
    from ..layers import MoE  # torch: deferred (routers/__init__)

    return MoE(router, experts, shared, channels_dim=layer.channels_dim, aux_loss_weights=dict(layer.aux_loss_weights),
               aux_loss_in_backward=layer.aux_loss_in_backward, aux_loss_backward_scale=layer.aux_loss_backward_scale)


def routed_pairs(moe: MoE) -> tuple[Any, float]:
    """Inspection of a sparse layer's last forward: [B, E] (item, expert) pairs per image, and the items no
    expert took."""
    import torch  # torch: deferred (routers/__init__)

    routing, images = moe.last_routing, moe.last_images
    per_image = moe.last_items // images
    expert = torch.repeat_interleave(torch.arange(moe.num_experts), routing.counts.cpu())
    image = routing.item.cpu()[:len(expert)] // per_image  # the pairs in segments (not those a capacity dropped)
    pairs = torch.zeros(images, moe.num_experts, dtype=torch.float64)
    pairs.index_put_((image, expert), torch.ones(len(expert), dtype=torch.float64), accumulate=True)
    return pairs, float((~routing.kept).sum())


TOKENS = Inspection(unit="token", share_label="share of the class's tokens\nsent to the expert", tally=routed_pairs)
"""What `moespec inspect` counts for the routers that send tokens to experts: (token, expert) pairs."""

"""What token choice (`topk`) and image routing (`image`) share: each routed item (a token, an image) picks its
top k experts from a gate's scores, with DeepSeek-V3's routing options (sigmoid scores, a route scale,
group-limited top-k, the aux-loss-free balancing bias) and an eval-time k. `ChoiceRouterSpec` holds those
settings and what follows from them; the two kinds add their own.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import model_validator

from ..spec.fields import FloatRange, IntRange, SpecModel
from ..spec.models import MAX_EXPERTS
from ..spec.registry import FieldError, RouterSpec
from .gates import Gate, GateField

MAX_BIAS_RATE = 1.0
"""`bias_balance.rate`: DeepSeek-V3 uses 0.001 (DeepSeek-AI 2024); softmax and sigmoid scores lie in [0, 1], so a
rate of 1 already moves a bias across the whole score range in one step."""
MAX_ROUTE_SCALE = 100.0
"""`scale`: DeepSeek-V3 uses 2.5 (torchtitan's `route_scale`); 100 x a combine weight of at most 1 is already far
beyond any published setting."""


class BiasBalance(SpecModel):
    """Auxiliary-loss-free load balancing (DeepSeek-V3, DeepSeek-AI 2024; Wang et al. 2024): a per-expert bias,
    added to the scores only to choose the top k in training (the combine weights stay the unbiased scores),
    moves by `rate * sign(mean load - load_e)` once per optimizer step (`moespec.update_bias`). It is a buffer,
    not a parameter: saved in checkpoints, untouched by the optimizer, unused in eval."""

    rate: FloatRange(0.0, MAX_BIAS_RATE, low_open=True) = 0.001
    """The bias update speed gamma; DeepSeek-V3: 0.001."""


class ExpertGroups(SpecModel):
    """Group-limited top-k (DeepSeek-V3's n_group / topk_group): the experts are `count` groups of E / count; each
    item keeps the `top` groups with the highest group score (the sum of its two highest scores) and picks its
    top k among their experts."""

    count: IntRange(1, MAX_EXPERTS)
    """G: expert groups; must divide the experts."""
    top: IntRange(1, MAX_EXPERTS)
    """g: groups each item may route to, 1 <= g <= G."""

    @model_validator(mode="after")
    def _top_within_count(self) -> "ExpertGroups":
        if self.top > self.count:
            raise FieldError("top", f"top ({self.top}) must be between 1 and count ({self.count})")
        return self


class ChoiceRouterSpec(RouterSpec):
    """A router whose routed items (tokens for `topk`, images for `image`) each pick their top k experts."""

    top_k: IntRange(1, MAX_EXPERTS) = 1
    """Experts per routed item k, 1 <= k <= experts."""
    gate: GateField = Gate()
    normalize: bool = False
    """Renormalize the k selected gate values to sum to 1 (makes an upcycled model exactly dense)."""
    score: Literal["softmax", "sigmoid"] = "softmax"
    """How logits become scores: `softmax` over the experts, or `sigmoid` of each (DeepSeek-V3), whose k chosen
    scores are always renormalized to sum to 1 (so `normalize` matters for softmax only)."""
    scale: FloatRange(0.0, MAX_ROUTE_SCALE, low_open=True) = 1.0
    """Multiplies the combine weights (DeepSeek-V3's route scale, 2.5)."""
    bias_balance: Optional[BiasBalance] = None
    """Auxiliary-loss-free load balancing (DeepSeek-V3) over the routed items; pair it with `aux_loss: []`."""
    groups: Optional[ExpertGroups] = None
    """Group-limited top-k (DeepSeek-V3): `{count: G, top: g}`."""
    eval_top_k: Optional[IntRange(1, MAX_EXPERTS)] = None
    """k in eval mode (Tutel's per-call top_k); default: top_k."""

    def check_experts(self, num_experts: int) -> None:
        """`top_k` and `eval_top_k` against the routed experts and `groups`."""
        for field, k in (("top_k", self.top_k), ("eval_top_k", self.eval_top_k)):
            if k is not None and k > num_experts:
                raise FieldError(field, f"{field} ({k}) must be between 1 and experts ({num_experts})")
        if self.groups is None:
            return
        count, top = self.groups.count, self.groups.top
        if num_experts % count:
            raise FieldError("groups", f"groups.count ({count}) must divide experts ({num_experts}) into equal groups")
        reachable = top * (num_experts // count)
        for field, k in (("top_k", self.top_k), ("eval_top_k", self.eval_top_k)):
            if k is not None and k > reachable:
                raise FieldError(field, f"{field} ({k}) is more than the {reachable} experts of the groups.top ({top}) "
                                        f"groups of {num_experts // count} an item may use; lower {field} or raise "
                                        f"groups.top")

    def choice_options(self) -> dict[str, Any]:
        """The router module's keyword arguments for these settings (`layers.TopKRouter`, `layers.ImageRouter`)."""
        return {"normalize": self.normalize, "score": self.score, "scale": self.scale,
                "bias_rate": self.bias_balance.rate if self.bias_balance is not None else None,
                "expert_groups": None if self.groups is None else (self.groups.count, self.groups.top),
                "eval_top_k": self.eval_top_k}

    def choice_labels(self) -> list[tuple[str, bool]]:
        """The plan-column labels of these settings, each with whether it is shown."""
        groups, bias = self.groups, self.bias_balance
        return [("norm", self.normalize and self.score == "softmax"), ("sigmoid", self.score == "sigmoid"),
                (f"scale={self.scale:g}", self.scale != 1.0),
                (f"groups={groups.top}/{groups.count}" if groups else "", groups is not None),
                (f"bias-balance={bias.rate:g}" if bias else "", bias is not None),
                (f"eval-k={self.eval_top_k}", self.eval_top_k not in (None, self.top_k))]

    def picks(self) -> int:
        return self.top_k

    def eval_picks(self) -> int:
        return self.eval_top_k or self.top_k

    def caveats(self, layer: Any) -> list[str]:
        """Why the top-k choice may not compute an upcycled layer's dense FFN."""
        found = []
        if not self.normalize and self.score == "softmax" and self.top_k < layer.num_experts:
            found.append(f"the top-{self.top_k} gates are not renormalized (normalize: false), so the FFN output is "
                         f"scaled by the kept gate mass")
        if self.scale != 1.0:
            found.append(f"the combine weights are multiplied by scale ({self.scale:g}), and so is the FFN output")
        return found

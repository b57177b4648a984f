"""Routers: from items [T, C] to a `Routing` (which item goes to which expert, with which weight).

Every router returns the same thing: (item, expert) pairs already sorted by expert, so the MoE layer runs
each expert on one contiguous segment and scatters the weighted outputs back. Routers are plain modules
that take numbers, never specs; each router kind of `moespec/routers/` builds its module. Their gates (item
features to expert logits) and DeepSeek-V3's balancing bias are in `gates.py`.

    topk           token choice: each item picks k experts; optional noise, capacity, BPR, importance drop
    image          one decision per image (from its [CLS] or mean token), shared by all its tokens
    expert choice  each expert picks its top C = c * T / E items
(Soft MoE has no discrete routing; it is its own layer in `soft.py`.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .gates import BalancingBias, LinearGate, ProjectedGate  # noqa: F401 (LinearGate, ProjectedGate: re-exported)
from .interfaces import Router
from .ops.mode import Mode
from .ops.pairs import softmax_topk
from .routing import (
    Groups,
    Routing,
    at_least_fp32,
    group_pairs,
    items_per_image,
    kept_first,
    load_counts,
    smooth_load,
)


def choose_experts(noisy: torch.Tensor, top_k: int, *, score: str = "softmax", normalize: bool = False,
                   scale: float = 1.0, balance: BalancingBias | None = None,
                   expert_groups: tuple[int, int] | None = None,
                   pair_ops: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-k choice of token choice and image routing, from (noisy) logits [U, E]: the scores (softmax, or
    sigmoid renormalized over the k chosen, DeepSeek-V3), the choice (on the scores plus `balance`'s bias where
    given, within the `expert_groups` (G, g) where given), the chosen scores as weights (renormalized with
    `normalize`, times `scale`). Returns (probs [U, E] for the aux losses, weights [U, k], experts [U, k]);
    sigmoid scores are normalized over the experts for the aux losses, as DeepSeek-V3's sequence-wise loss does.
    The scores are computed in fp32 (fp64 for fp64 logits); with `pair_ops` (the layer's `Mode.pair_ops`: the
    sync-free path) a plain softmax top-k runs as one op (`ops.pairs.softmax_topk`)."""
    sigmoid = score == "sigmoid"
    if not sigmoid and balance is None and expert_groups is None and pair_ops:
        probs, weights, experts = softmax_topk(noisy, top_k)  # one op: one kernel on a GPU
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights * scale if scale != 1.0 else weights, experts
    noisy = at_least_fp32(noisy)
    scores = noisy.sigmoid() if sigmoid else noisy.softmax(dim=-1)
    if balance is not None or expert_groups is not None:
        choice = scores + balance.expert_bias if balance is not None else scores
        if expert_groups is not None:
            choice = limit_to_groups(choice, *expert_groups)
        experts = choice.topk(top_k, dim=-1).indices
        weights = scores.gather(-1, experts)  # the unbiased scores of the chosen experts
    else:
        weights, experts = scores.topk(top_k, dim=-1)
    if normalize or sigmoid:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scale != 1.0:
        weights = weights * scale
    return (scores / scores.sum(dim=-1, keepdim=True) if sigmoid else scores), weights, experts


class ChoiceRouter(Router):
    """What token choice and image routing share: a gate, the top-k choice (`choose_experts`) with DeepSeek-V3's
    options, the balancing bias and an eval-time k. The arguments are `TopKRouter`'s."""

    def __init__(self, gate: nn.Module, num_experts: int, top_k: int, *, normalize: bool = False,
                 score: str = "softmax", scale: float = 1.0, bias_rate: float | None = None,
                 expert_groups: tuple[int, int] | None = None, eval_top_k: int | None = None):
        super().__init__()
        self.gate, self.num_experts, self.top_k = gate, num_experts, top_k
        self.normalize, self.score, self.scale = normalize, score, scale
        self.expert_groups, self.eval_top_k = expert_groups, eval_top_k
        self.balance = BalancingBias(num_experts, bias_rate) if bias_rate is not None else None

    def active_top_k(self) -> int:
        """k in the current mode: `eval_top_k` in eval, where one is set."""
        return self.top_k if self.training or self.eval_top_k is None else self.eval_top_k

    def router_weights(self) -> list[nn.Parameter]:
        return self.gate.router_weights()

    def point_at(self, vectors: torch.Tensor) -> None:
        self.gate.point_at(vectors)

    def row_metric(self) -> str:
        return self.gate.metric

    def experts_per_item(self, items: int, images: int) -> int:
        return self.active_top_k()

    def biased(self) -> bool:
        """Whether the balancing bias chooses (and counts) in the current mode: in training, where there is one."""
        return self.training and self.balance is not None

    def choose(self, logits: torch.Tensor, mode: Mode) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`choose_experts` on `logits` [U, E] with this router's options in the current training mode, in a layer
        call that runs as `mode` says; the bias, where it chooses, counts the choices. Returns (probs, weights,
        experts)."""
        balance = self.balance if self.biased() else None
        probs, weights, experts = choose_experts(logits, self.active_top_k(), score=self.score,
                                                 normalize=self.normalize, scale=self.scale, balance=balance,
                                                 expert_groups=self.expert_groups, pair_ops=mode.pair_ops)
        if balance is not None:
            balance.count(experts)
        return probs, weights, experts

    def choice_repr(self) -> list[tuple[str, bool]]:
        """`extra_repr`'s entries for these options, each with whether it is shown."""
        return [(f"score={self.score}", self.score != "softmax"), (f"scale={self.scale:g}", self.scale != 1.0),
                (f"expert_groups={self.expert_groups}", self.expert_groups is not None),
                (f"eval_top_k={self.eval_top_k}", self.eval_top_k is not None)]


class TopKRouter(ChoiceRouter):
    """Token choice top-k (Shazeer et al. 2017), optionally noisy, capacity-limited, BPR, importance drop, with
    DeepSeek-V3's routing options (sigmoid scores, a route scale, group-limited top-k and the aux-loss-free
    balancing bias; DeepSeek-AI 2024).

    Args:
        gate: a gate module mapping items [T, C] to logits [T, E].
        num_experts: E.  top_k: k.
        normalize: renormalize the k kept gate values to sum to 1.
        noise_std: std of N(0, std^2) added to the logits in training (0: none).
        capacity_factor: each expert keeps at most ceil(c * k * T / E) pairs (None: dropless).
        bpr: fill capacity by each item's top-1 gate value instead of item order (Riquelme et al. 2021).
        drop_fraction: importance-score routing (Sparse-MLP): this fraction of items, those with the lowest
            top-1 gate value, is not dispatched.
        group: images per routing group (1: each image alone; None: the whole batch). Capacity, BPR order and
            drops are decided within each group, T above being the group's items.
        score: `softmax` over the experts, or `sigmoid` of each logit (DeepSeek-V3), whose k kept values are
            always renormalized to sum to 1.
        scale: multiplies the combine weights (DeepSeek-V3's `route_scale`).
        bias_rate: aux-loss-free load balancing (DeepSeek-V3) at this rate: `balance`, a `BalancingBias`, whose
            bias is added to the scores only to choose the top k in training, the weights staying the unbiased
            scores. None: no bias.
        expert_groups: (G, g), group-limited top-k (DeepSeek-V3's n_group / topk_group): the experts are G
            groups of E / G; each item keeps the g groups with the highest group score (the sum of the group's
            two highest scores, as DeepSeek-V3 and torchtitan do) and picks its top k among their experts.
        eval_top_k: k in eval mode (Tutel takes top_k per call); None: `top_k`.
        eval_capacity_factor: c in eval mode (DeepSpeed's eval_capacity_factor): a number, None (dropless), or
            "training" (the default): the training c.
        capacity_multiple: each expert's capacity per group is rounded up to a multiple of this (V-MoE's
            `_compute_capacity` rounds up to a multiple of 4; 1: no rounding).
    """

    def __init__(self, gate: nn.Module, num_experts: int, top_k: int, *, normalize: bool = False,
                 noise_std: float = 0.0, capacity_factor: float | None = None, bpr: bool = False,
                 drop_fraction: float = 0.0, group: int | None = 1, score: str = "softmax", scale: float = 1.0,
                 bias_rate: float | None = None, expert_groups: tuple[int, int] | None = None,
                 eval_top_k: int | None = None, eval_capacity_factor: float | str | None = "training",
                 capacity_multiple: int = 1):
        super().__init__(gate, num_experts, top_k, normalize=normalize, score=score, scale=scale,
                         bias_rate=bias_rate, expert_groups=expert_groups, eval_top_k=eval_top_k)
        self.noise_std, self.capacity_factor, self.bpr = noise_std, capacity_factor, bpr
        self.drop_fraction, self.group, self.eval_capacity_factor = drop_fraction, group, eval_capacity_factor
        self.capacity_multiple = capacity_multiple

    def active_capacity_factor(self) -> float | None:
        """c in the current mode: `eval_capacity_factor` in eval, unless it is "training"."""
        if self.training or self.eval_capacity_factor == "training":
            return self.capacity_factor
        return self.eval_capacity_factor

    def capacity(self, items: int) -> int | None:
        factor = self.active_capacity_factor()
        if factor is None:
            return None
        capacity = math.ceil(factor * self.active_top_k() * items / self.num_experts)
        return -(-capacity // self.capacity_multiple) * self.capacity_multiple

    def dispatched(self, items: int) -> int:
        """Items that importance-score routing keeps out of `items`."""
        return items - math.floor(self.drop_fraction * items)

    def gate_macs(self, items: int, images: int) -> int:
        return items * self.gate.macs_per_item()

    def capacity_rows(self, items: int) -> float | None:
        """Expert rows per `items` (one image's) when every expert runs its full capacity in full routing
        groups (None when dropless): E * capacity(T_group) / images per group."""
        if self.active_capacity_factor() is None:
            return None
        images = self.group or 1  # `batch` is costed at the stats' batch, one image
        return self.num_experts * self.capacity(items * images) / images

    def group_slots(self, items: int) -> tuple[int, int] | None:
        if self.active_capacity_factor() is None:
            return None
        images = self.group or 1  # `batch` is costed at the stats' batch, one image
        return images, self.num_experts * self.capacity(items * images)

    def route(self, x: torch.Tensor, images: int = 1, mode: Mode | None = None) -> Routing:
        mode = Mode.of(x) if mode is None else mode
        logits = self.gate(x)  # in the gate's dtype: the scores are computed in fp32 (`choose_experts`)
        noisy = logits
        if self.training and self.noise_std > 0:
            logits = at_least_fp32(logits)
            noisy = logits + torch.randn_like(logits) * self.noise_std
        top_k = self.active_top_k()
        probs, weights, experts = self.choose(noisy, mode)  # eval ignores the bias
        groups = Groups.of(x.shape[0], images, self.group, self.training)
        dispatched = None
        if self.drop_fraction > 0:  # the lowest top-1 gates of each group
            dropped = groups.per_group([math.floor(self.drop_fraction * n) for n in groups.sizes()], x.device)
            rank = groups.rank(weights[:, 0], x.device, exporting=mode.exporting)
            dispatched = rank >= dropped[groups.of_item(x.device)]
        capacity = None if self.active_capacity_factor() is None else [self.capacity(n) for n in groups.sizes()]
        pairs = group_pairs(experts, weights, self.num_experts, mode, priority=weights[:, 0] if self.bpr else None,
                            capacity=capacity, groups=groups, dispatched=dispatched, dtype=x.dtype)
        noise = self.noise_std if self.training and not self.biased() and self.expert_groups is None else 0.0
        if pairs.ends is not None and noise <= 0:  # every choice is in its expert's segment: the load is the counts
            load = pairs.counts
        elif noise <= 0:  # the noise model's smooth load knows no bias or groups
            load = load_counts(experts, self.num_experts)
        else:
            load = smooth_load(logits, noisy, top_k, noise, experts)
        return Routing(probs, logits, pairs.item, pairs.counts, pairs.weights, experts[:, 0], weights[:, 0], load,
                       pairs.kept, pairs.expert, dropped=pairs.dropped, position=pairs.position, mode=mode,
                       **_choices(pairs, weights, experts))

    def extra_repr(self) -> str:
        extras = [("normalize=True", self.normalize), (f"noise_std={self.noise_std:g}", self.noise_std > 0),
                  (f"capacity_factor={self.capacity_factor}", self.capacity_factor is not None),
                  ("bpr=True", self.bpr), (f"drop_fraction={self.drop_fraction:g}", self.drop_fraction > 0),
                  (f"group={self.group}", self.capacity_factor is not None or self.drop_fraction > 0),
                  *self.choice_repr(),
                  (f"eval_capacity_factor={self.eval_capacity_factor}", self.eval_capacity_factor != "training"),
                  (f"capacity_multiple={self.capacity_multiple}", self.capacity_multiple != 1)]
        return ", ".join([f"experts={self.num_experts}, top_k={self.top_k}"] + [text for text, on in extras if on])


def _choices(pairs, weights: torch.Tensor, experts: torch.Tensor) -> dict:
    """`Routing`'s segment ends and each choice's gate and expert [T, k], where the pairs came from
    `ops.pairs.sort_pairs` (no capacity, no drop): the combine reads the gates in choice order."""
    if pairs.ends is None:
        return {}
    return {"ends": pairs.ends, "gates": weights, "choices": experts}


def limit_to_groups(scores: torch.Tensor, count: int, top: int) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3): `scores` [T, E] with the experts outside each item's `top` best of
    `count` expert groups set to -inf. A group's score is the sum of its two highest scores (one, for groups of
    one expert), as in DeepSeek-V3's and torchtitan's routers."""
    items, experts = scores.shape
    grouped = scores.view(items, count, experts // count)
    group_scores = grouped.topk(min(2, experts // count), dim=-1).values.sum(dim=-1)  # [T, G]
    kept = group_scores.topk(top, dim=-1).indices
    # the source as a tensor: the jit tracer (fvcore's FlopCountAnalysis) has no scatter_ of a Python bool
    mask = torch.ones(items, count, dtype=torch.bool, device=scores.device).scatter_(1, kept, kept.new_zeros(
        kept.shape, dtype=torch.bool))
    return grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).view(items, experts)


class ImageRouter(ChoiceRouter):
    """Image-level routing (ViMoE): the gate reads one vector per image, the [CLS] token (`pool="cls"`,
    the first token of each image's sequence) or the mean token, and picks top-k experts for every token
    of that image. `score`, `scale`, `bias_rate`, `expert_groups` and `eval_top_k` are `TopKRouter`'s, per image.
    """

    def __init__(self, gate: nn.Module, num_experts: int, top_k: int, *, normalize: bool = False, pool: str = "cls",
                 score: str = "softmax", scale: float = 1.0, bias_rate: float | None = None,
                 expert_groups: tuple[int, int] | None = None, eval_top_k: int | None = None):
        super().__init__(gate, num_experts, top_k, normalize=normalize, score=score, scale=scale,
                         bias_rate=bias_rate, expert_groups=expert_groups, eval_top_k=eval_top_k)
        self.pool = pool

    def gate_macs(self, items: int, images: int) -> int:
        return images * self.gate.macs_per_item()  # one decision per image

    def gate_input(self, x: torch.Tensor, images: int = 1) -> torch.Tensor:
        """One vector per image: its [CLS] (first) token or its mean token, [images, C]."""
        per_image = x.reshape(images, items_per_image(x.shape[0], images), x.shape[-1])
        return per_image[:, 0] if self.pool == "cls" else per_image.mean(dim=1)

    def route(self, x: torch.Tensor, images: int = 1, mode: Mode | None = None) -> Routing:
        mode = Mode.of(x) if mode is None else mode
        per_image = x.reshape(images, items_per_image(x.shape[0], images), x.shape[-1])
        vectors = self.gate_input(x, images)
        logits = self.gate(vectors)
        probs, weights, experts = self.choose(logits, mode)  # one choice per image: the bias's loads are images
        tokens = per_image.shape[1]
        token_experts = experts.repeat_interleave(tokens, dim=0)
        token_weights = weights.repeat_interleave(tokens, dim=0)
        pairs = group_pairs(token_experts, token_weights, self.num_experts, mode, dtype=x.dtype)
        return Routing(probs, logits, pairs.item, pairs.counts, pairs.weights, experts[:, 0], weights[:, 0],
                       load_counts(experts, self.num_experts), pairs.kept, pairs.expert, position=pairs.position,
                       mode=mode, **_choices(pairs, token_weights, token_experts))

    def extra_repr(self) -> str:
        return ", ".join([f"experts={self.num_experts}, top_k={self.top_k}, normalize={self.normalize}, "
                          f"pool={self.pool}"] + [text for text, on in self.choice_repr() if on])


class ExpertChoiceRouter(Router):
    """Expert choice (Zhou et al. 2022): probs = softmax over experts; expert i takes the C items with the
    highest probs[:, i], C = round(c * T / E) (at least 1, at most T), within each routing group of `group`
    images (1: each image alone; None: the whole batch), T being the group's items. An item may be taken by
    several experts or by none."""

    def __init__(self, gate: nn.Module, num_experts: int, capacity: float = 1.0, group: int | None = 1):
        super().__init__()
        self.gate, self.num_experts, self.capacity_per_item = gate, num_experts, capacity
        self.group = group

    def router_weights(self) -> list[nn.Parameter]:
        return self.gate.router_weights()

    def point_at(self, vectors: torch.Tensor) -> None:
        self.gate.point_at(vectors)

    def row_metric(self) -> str:
        return self.gate.metric

    def capacity(self, items: int) -> int:
        if isinstance(items, torch.Tensor):  # a TorchScript trace (fvcore's) gives sizes as 0-d tensors
            items = int(items)
        return min(items, max(1, round(self.capacity_per_item * items / self.num_experts)))

    def gate_macs(self, items: int, images: int) -> int:
        return items * self.gate.macs_per_item()

    def group_slots(self, items: int) -> tuple[int, int] | None:
        images = self.group or 1  # `batch` is costed at the stats' batch, one image
        return images, self.num_experts * self.capacity(items * images)

    def experts_per_item(self, items: int, images: int) -> float:
        """E * C rows for T items: about c expert passes per item."""
        return self.num_experts * self.capacity(items) / items if items else self.capacity_per_item

    def route(self, x: torch.Tensor, images: int = 1, mode: Mode | None = None) -> Routing:
        mode = Mode.of(x) if mode is None else mode
        logits = at_least_fp32(self.gate(x))
        probs = logits.softmax(dim=-1)
        groups = Groups.of(x.shape[0], images, self.group, self.training)
        experts, size, count = self.num_experts, groups.items, groups.count
        full, last = (self.capacity(n) for n in groups.sizes())  # the last group may be shorter (eval)
        padded = F.pad(probs, (0, 0, 0, count * size - x.shape[0]), value=-1.0)  # a padding row is never chosen
        values, chosen = padded.reshape(count, size, experts).transpose(1, 2).topk(full, dim=-1)  # [G, E, C]
        item = (chosen + torch.arange(count, device=x.device).view(-1, 1, 1) * size).transpose(0, 1)  # [E, G, C]
        values, expert = values.transpose(0, 1), torch.arange(experts, device=x.device).view(-1, 1, 1)
        expert = expert.expand_as(item)
        item, values, expert = item.reshape(-1), values.reshape(-1), expert.reshape(-1)
        counts = torch.full((experts,), full * (count - 1) + last, dtype=torch.long, device=x.device)
        dropped = False
        if last < full:  # keep only the last group's own C choices
            keep = torch.arange(full, device=x.device) < groups.per_group((full, last), x.device).view(-1, 1)
            keep = keep.expand(experts, count, full).reshape(-1)
            if mode.exporting:
                values, item = values * keep, item.clamp(max=x.shape[0] - 1)
            elif mode.sync_free:  # the choices left out after the segments, with weight 0 (`Routing.dropped`)
                last = kept_first(keep)
                item, values, expert = item[last].clamp(max=x.shape[0] - 1), (values * keep)[last], expert[last]
                keep, dropped = keep[last], True
            else:
                item, values, expert = item[keep], values[keep], expert[keep]
        kept = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        kept = kept.index_put_((item,), keep, accumulate=True) if dropped else kept.index_fill_(0, item, 1)
        top1_value, top1 = probs.max(dim=-1)
        return Routing(probs, logits, item, counts, values.to(x.dtype), top1, top1_value,
                       counts.float(), kept, expert, dropped=dropped, mode=mode)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, capacity={self.capacity_per_item:g}, group={self.group}"

"""What a router decides, and what is computed from it: the `Routing` of one forward, the grouping of
(item, expert) choices into per-expert segments (with capacity, priority and drops), and the aux losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from .ops.collectives import all_reduce_sum
from .ops.mode import Mode
from .ops.pairs import inverse_permutation, narrow_ids, sort_pairs, stable_argsort
from .steps.rows import RoutedRows, Segments


@dataclass
class Routing:
    """The routing decision of one forward.

    Attributes:
        probs: [U, E] softmax of the router logits per decision unit (item, or image for image routing).
        logits: [U, E] router logits (before noise), in the gate's dtype (fp32 under router noise).
        item: [P] item index of each (item, expert) pair, pairs grouped by expert in expert order.
        counts: [E] pairs per expert (segment lengths).
        weights: [P] gate value each pair's expert output is scaled by.
        top1: [U] best expert per decision unit; top1_value: [U] its gate probability.
        load: [E] items assigned to each expert before any capacity drop (smooth under router noise; where it is
            a count, possibly as integers).
        kept: [T] whether each item was dispatched to at least one expert.
        expert: [P] expert of each pair.
        group: the process group of an expert-parallel layer (None in one process): aux losses and statistics
            sum over it (`total`), so that they equal one process's on the whole batch.
        dropped: pairs a capacity or a drop left out follow the experts' segments, with weight 0, so that every
            item keeps its k rows; sum(counts) < P then (`steps.rows.Segments`).
        position: [T, k] where each item's k choices are among the P = T * k sorted pairs (routing where every
            item makes k choices: token choice and image routing); None elsewhere. With it, the layer gathers
            and combines each item's rows without a scatter (`Experts.combine`).
        ends: [E] int32 end of each expert's segment, where routing computed it; gates: [T, k] the gate of each
            choice and choices: [T, k] its expert, where routing has them in choice order (plain top-k on the
            sync-free path, `ops.pairs`): the combine then reads them without a gather (`steps.rows.RoutedRows`).
        mode: how the layer call runs (`ops.mode.Mode`), which the router was given; the rows carry it on.
    """

    probs: torch.Tensor
    logits: torch.Tensor
    item: torch.Tensor
    counts: torch.Tensor
    weights: torch.Tensor
    top1: torch.Tensor
    top1_value: torch.Tensor
    load: torch.Tensor
    kept: torch.Tensor
    expert: torch.Tensor | None = None
    group: object = None
    dropped: bool = False
    position: torch.Tensor | None = None
    ends: torch.Tensor | None = None
    gates: torch.Tensor | None = None
    choices: torch.Tensor | None = None
    mode: Mode = Mode()

    @property
    def num_experts(self) -> int:
        return self.probs.shape[-1]

    @property
    def rows(self) -> RoutedRows:
        """The routed rows as the experts take them (`steps.rows.RoutedRows`)."""
        segments = Segments(self.counts, self.dropped, self.ends, None if self.dropped else self.expert)
        return RoutedRows(self.item, self.weights, segments, self.mode, self.position, self.gates, self.choices)

    def total(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor summed over the ranks of `group` (as it is in one process); differentiable."""
        return all_reduce_sum(tensors, self.group)


@dataclass(frozen=True)
class Groups:
    """The routing groups of one forward: `images` images of `per_image` items each, split into groups of
    `size` consecutive images (the last one shorter when the batch is not a multiple, allowed in eval only).
    Routers decide capacity, priority and drops within each group, in one batched pass."""

    count: int  # G
    items: int  # items in a full group, T_g
    total: int  # items in the batch, T

    @classmethod
    def of(cls, items: int, images: int, size: int | None, training: bool) -> "Groups":
        """`size` images per group (None: the whole batch is one group)."""
        if size == 1 and images:  # each image alone: the group sizes stay numbers under an export's dynamic batch
            return cls(count=images, items=constant(items_per_image(items, images)), total=items)
        size = max(1, images if size is None else min(size, images))  # an empty batch is one empty group
        if training and images % size:
            raise ValueError(f"a training batch of {images} images is not a multiple of the routing group of {size} "
                             f"images (router.group); use a batch size divisible by {size}, or group: image")
        return cls(count=max(1, -(-images // size)), items=size * items_per_image(items, images), total=items)

    def sizes(self) -> tuple[int, int]:
        """Items in a full group and in the last (shorter where the batch is not a multiple of the group): two
        numbers whatever the number of groups, so that an export with a dynamic batch traces them."""
        return self.items, constant(self.total - self.items * (self.count - 1))

    def per_group(self, values: Sequence[int], device: torch.device) -> torch.Tensor:
        """[G] one value per group from (a full group's, the last group's), as `sizes()` gives the sizes, made on
        the device without a copy from the host (which waits for the device)."""
        last = torch.arange(self.count, device=device) == self.count - 1
        return torch.where(last, values[1], values[0])

    def of_item(self, device: torch.device) -> torch.Tensor:
        """[T] group index of each item."""
        return torch.arange(self.total, device=device) // self.items

    def rank(self, key: torch.Tensor | None, device: torch.device, descending: bool = False, *,
             exporting: bool) -> torch.Tensor:
        """[T] each item's place in its group: by position, or by `key` [T] (stable; `exporting`: torch.export
        traces, `ops.pairs.stable_argsort`)."""
        group = self.of_item(device)
        position = torch.arange(self.total, device=device) - group * self.items
        if key is None:
            return position
        order = stable_argsort(key, descending=descending, exporting=exporting)
        order = order[stable_argsort(group[order], exporting=exporting)]  # by group, then by key
        return torch.empty_like(position).scatter_(0, order, position)  # index_copy_, as ONNX converts it cleanly


def constant(n: int) -> int:
    """`n` as a plain int where it is one: under an export with a dynamic batch, sizes such as (17 x batch) //
    batch are symbols whose value is a constant, and the arithmetic on them (capacity's `round`) would be
    traced into the graph, which ONNX cannot convert."""
    return int(n) if isinstance(n, torch.SymInt) and is_concrete_int(n) else n


def items_per_image(items: int, images: int) -> int:
    """Items of each image in a batch of `items` items from `images` images; 1 for an empty batch (0 images),
    where every per-image shape [0, n, C] holds nothing and n = 1 keeps indexing an image's first item valid."""
    return items // images if images else 1


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32, or float64 if it is: router logits and GRN's squares are never computed in 16 bits."""
    return t if t.dtype == torch.float64 else t.float()


class Pairs(NamedTuple):
    item: torch.Tensor  # [P] item of each pair, grouped by expert
    counts: torch.Tensor  # [E] pairs per expert
    weights: torch.Tensor  # [P] gate value of each pair
    expert: torch.Tensor  # [P] expert of each pair
    kept: torch.Tensor  # [T] whether the item is in at least one pair (of non-zero weight, when static)
    dropped: bool = False  # pairs left out follow the segments, with weight 0 (`Routing.dropped`)
    position: torch.Tensor | None = None  # [T, k] sorted place of each choice (not while exporting)
    ends: torch.Tensor | None = None  # [E] int32 segment ends, where `ops.pairs.sort_pairs` computed them


def group_pairs(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, mode: Mode, *,
                priority: torch.Tensor | None = None, capacity: Sequence[int] | None = None,
                groups: Groups | None = None, dispatched: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> Pairs:
    """Group the choices `experts` [T, k] (gate values `weights` [T, k]) by expert, in a layer call that runs as
    `mode` says; the pairs' weights in `dtype` (None: the weights').

    Without a capacity or a drop, on the sync-free path, one op does it all (`ops.pairs.sort_pairs`).

    Only the items where `dispatched` [T] is true take part (None: all). With a `capacity` (a full routing
    group's and the last group's, as `Groups.sizes`), each expert keeps, in each group, its first C pairs in
    fill order: first choices before second choices, then by item position, or by `priority` [T] descending
    (BPR).

    The pairs left out stay, with weight 0, after the experts' segments (`dropped`), so that every item keeps
    its k rows (`position`: the layer combines by gathers) and, on the sync-free path (`Mode.sync_free`: a
    GPU, torch.compile), no shape depends on the data. While `torch.export` traces (`static`), every one of the
    T * k choices stays in its expert's segment with weight 0 if dropped; the MoE layer then combines densely.
    """
    static = mode.exporting
    tokens, top_k = experts.shape
    dtype = dtype or weights.dtype
    if capacity is None and dispatched is None and mode.pair_ops:
        item, expert, pair_weights, counts, ends, position = sort_pairs(experts, weights, num_experts, dtype)
        kept = torch.ones(tokens, dtype=torch.bool, device=experts.device)  # every item makes k >= 1 choices
        return Pairs(item, counts, pair_weights, expert, kept, position=position, ends=ends)
    flat = experts.reshape(-1)
    device = flat.device
    if dispatched is not None:  # items not dispatched go to a last, dummy expert: they take no capacity
        flat = torch.where(dispatched.repeat_interleave(top_k), flat, num_experts)
    buckets = num_experts + 1
    if capacity is None:
        order = stable_argsort(narrow_ids(flat, buckets, exporting=static), exporting=static)
        bucket = flat
    else:  # buckets (expert, group), expert-major, so that the pairs come out grouped by expert
        groups = groups or Groups(1, tokens, tokens)
        rank = groups.rank(priority, device, descending=True, exporting=static).repeat_interleave(top_k)
        slot = torch.arange(top_k, device=device).repeat(tokens)
        bucket = flat * groups.count + groups.of_item(device).repeat_interleave(top_k)
        order = torch.argsort((bucket * top_k + slot) * groups.items + rank)
        buckets *= groups.count
    counts = torch.zeros(buckets, dtype=torch.long, device=device).scatter_add_(
        0, bucket, torch.ones_like(bucket))  # the dummy expert last; bincount's length would depend on the data
    expert = flat[order]
    keep = expert < num_experts
    if capacity is not None:
        limit = groups.per_group(capacity, device).repeat(num_experts + 1)  # per bucket
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(order.numel(), device=device) - starts[bucket[order]]  # rank within its bucket
        keep = keep & (position < limit[bucket[order]])
        counts = counts.clamp(max=limit).reshape(num_experts + 1, -1).sum(dim=1)
    counts = counts[:num_experts]
    pair_weights = weights.reshape(-1)[order]
    if static:
        item = order // top_k
        kept = torch.zeros(tokens, dtype=torch.bool, device=device).index_put_((item,), keep, accumulate=True)
        return Pairs(item, counts, (pair_weights * keep).to(dtype), expert.clamp(max=num_experts - 1), kept)
    if capacity is None and dispatched is None:
        item = order // top_k
        return Pairs(item, counts, pair_weights.to(dtype), expert, _covered(item, tokens),
                     position=inverse_permutation(order).view(tokens, top_k))
    last = kept_first(keep)  # the pairs left out after the segments (a stable sort keeps them grouped by expert)
    order, pair_weights, keep = order[last], pair_weights[last] * keep[last], keep[last]
    item = order // top_k
    kept = torch.zeros(tokens, dtype=torch.bool, device=device).index_put_((item,), keep, accumulate=True)
    return Pairs(item, counts, pair_weights.to(dtype), expert[last].clamp(max=num_experts - 1), kept, dropped=True,
                 position=inverse_permutation(order).view(tokens, top_k))


def kept_first(keep: torch.Tensor) -> torch.Tensor:
    """The order that puts the kept entries of `keep` [P] first and the left-out ones last, each in their order
    (a stable sort: pairs grouped by expert stay so). Never while exporting, where every pair stays in place."""
    return stable_argsort((~keep).to(torch.uint8), exporting=False)


def _covered(item: torch.Tensor, tokens: int) -> torch.Tensor:
    """[tokens] whether each item is in `item`."""
    return torch.zeros(tokens, dtype=torch.bool, device=item.device).index_fill_(0, item, 1)


def smooth_load(logits: torch.Tensor, noisy: torch.Tensor, top_k: int, noise_std: float,
          experts: torch.Tensor) -> torch.Tensor:
    """Load_i = sum over items of P(i is in the item's top-k). Without noise it is a count; with noise it is
    Shazeer's smooth estimate: Phi((clean_i - threshold) / std), the threshold being the k-th largest noisy
    logit among the other experts."""
    if noise_std <= 0 or top_k >= logits.shape[-1]:
        return load_counts(experts, logits.shape[-1])
    top = noisy.topk(top_k + 1, dim=-1).values
    is_in = noisy >= top[:, top_k - 1 : top_k]
    threshold = torch.where(is_in, top[:, top_k : top_k + 1], top[:, top_k - 1 : top_k])
    normal = torch.distributions.Normal(0.0, 1.0)
    return normal.cdf((logits - threshold) / noise_std).sum(dim=0)


def load_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] how many of the choices `experts` (any shape) pick each expert, as floats."""
    flat = experts.reshape(-1)
    ones = torch.ones(flat.numel(), device=flat.device)
    return torch.zeros(num_experts, device=flat.device).scatter_add_(0, flat, ones)


AUX_LOSSES: dict[str, Callable[[Routing], torch.Tensor]] = {}
"""Aux-loss kind (the spec's `aux_loss.kind`) -> function of a Routing."""


def register_aux_loss(kind: str) -> Callable[[Callable[[Routing], torch.Tensor]], Callable[[Routing], torch.Tensor]]:
    """Register the decorated function of a Routing as the aux loss `kind`."""

    def wrap(loss: Callable[[Routing], torch.Tensor]) -> Callable[[Routing], torch.Tensor]:
        AUX_LOSSES[kind] = loss
        return loss

    return wrap


@register_aux_loss("importance_load")
def importance_load_loss(routing: Routing) -> torch.Tensor:
    """Shazeer et al. 2017: (CV(importance)^2 + CV(load)^2) / 2, with Importance_i = sum_x p_i(x) and
    Load_i = sum_x P(i in top-k of x) (a count without router noise: only importance carries gradient)."""
    importance, load = routing.total(routing.probs.sum(dim=0), routing.load.to(routing.probs.dtype))
    return (_cv_squared(importance) + _cv_squared(load)) / 2


@register_aux_loss("switch")
def switch_loss(routing: Routing) -> torch.Tensor:
    """Fedus et al. 2021: E * sum_i f_i * P_i, f_i = share of units whose top-1 is i, P_i = mean prob of i."""
    experts, probs = routing.num_experts, routing.probs
    top1 = load_counts(routing.top1, experts)  # not F.one_hot, which checks its input's range on the host
    if routing.group is None:  # sums over max(units, 1): 0, not NaN, for an empty batch
        units = max(probs.shape[0], 1)
        return experts * (top1 / units * probs.sum(dim=0) / units).sum()
    top1, importance, units = routing.total(top1, probs.sum(dim=0), probs.new_tensor(probs.shape[0]))
    units = units.clamp(min=1)
    return experts * (top1 / units * importance / units).sum()


@register_aux_loss("z_loss")
def z_loss(routing: Routing) -> torch.Tensor:
    """ST-MoE router z-loss (Zoph et al. 2022): mean over units of logsumexp(logits)^2."""
    squares = torch.logsumexp(at_least_fp32(routing.logits), dim=-1).square()
    if routing.group is None:
        return squares.sum() / max(squares.numel(), 1)  # 0, not NaN, for an empty batch
    total, units = routing.total(squares.sum(), squares.new_tensor(squares.numel()))
    return total / units.clamp(min=1)


def _cv_squared(x: torch.Tensor) -> torch.Tensor:
    """Squared coefficient of variation, var(x) / mean(x)^2 (population variance; 0 for a single expert)."""
    if x.numel() <= 1:
        return x.new_zeros(())
    return x.var(unbiased=False) / (x.mean() ** 2 + 1e-10)


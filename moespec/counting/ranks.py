"""Per-rank figures under expert parallelism: how a spec's parameters and training memory split over W ranks.

Expert parallelism on W ranks splits each MoE layer's routed experts (its `experts` bank, E experts) evenly:
every rank holds E/W of them. Everything else (the backbone, routers and gates, Soft MoE's phi and scale,
shared experts) is replicated on every rank. A rank therefore holds `routed / W + replicated` parameters, and
trains them in fp32 with AdamW in 16 bytes each: the weight, its gradient and AdamW's two moments (exp_avg,
exp_avg_sq), 4 bytes apiece. Activations are not included: they depend on the batch, the resolution and
activation checkpointing, not on the spec alone.

A pure function of a `SpecStats` record and W; nothing is built here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import Problem, SpecError
from ..planning.ranks import uneven_experts
from .stats import SpecStats

TRAIN_BYTES_PER_PARAM = 16
"""fp32 training with AdamW: weight + gradient + exp_avg + exp_avg_sq, 4 bytes each."""


@dataclass(frozen=True)
class RankStats:
    """One spec on `ranks` ranks of expert parallelism: the parameters and fp32 training bytes of one rank."""

    ranks: int
    expert_params_per_rank: int  # the rank's share of the routed experts, summed over the MoE layers
    replicated_params: int  # everything else, held by every rank
    params_per_rank: int  # expert_params_per_rank + replicated_params
    train_bytes_per_rank: int  # TRAIN_BYTES_PER_PARAM * params_per_rank; activations not included


def per_rank(stats: SpecStats, ranks: int) -> RankStats:
    """`stats` split over `ranks` ranks of expert parallelism. Every MoE layer's experts must split evenly:
    otherwise a `SpecError` names the layers, their experts and the rank counts that would work (the
    divisors of the gcd of the layers' experts). A dense spec is all replicated, on any number of ranks."""
    if ranks < 1:
        raise SpecError(Problem(f"ranks must be at least 1, got {ranks}", file=stats.spec or None))
    uneven = uneven_experts({layer.path: layer.experts for layer in stats.layers}, ranks)
    if uneven:
        raise SpecError(Problem(uneven, file=stats.spec or None))
    routed = sum(layer.routed_params for layer in stats.layers)
    expert_params = sum(layer.routed_params // ranks for layer in stats.layers)  # exact: experts % ranks == 0
    replicated = stats.total_params - routed
    params = expert_params + replicated
    return RankStats(ranks=ranks, expert_params_per_rank=expert_params, replicated_params=replicated,
                     params_per_rank=params, train_bytes_per_rank=TRAIN_BYTES_PER_PARAM * params)

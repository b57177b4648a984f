"""Where an expert bank's rows are computed: the bank's `transport`, around its step (as torchtitan separates
its token dispatcher from its experts).

    Local     (every bank in one process) the rows go straight to the bank's step
    AllToAll  (expert parallelism) the rows go to the ranks that hold their experts and come back

Under expert parallelism rank r of W holds experts [r * E/W, (r+1) * E/W) of every sharded bank (`shard_bank`:
the bank keeps its class and its state-dict names, with this rank's slice of each stacked parameter); the rest
of the model is replicated. One forward of a token-choice bank (rows sorted by global expert, `counts` [E]):

    counts exchange     all_to_all_single of the [E] counts: each rank learns how many rows it will receive
    dispatch            all_to_all_single of the rows, variable splits (rank-major: source rank, then expert)
    permute             rank-major -> expert-major, so that each local expert has one contiguous segment
    local experts       the bank's step on the E/W local experts (`ExpertBank.run_local`)
    un-permute, return  the inverse permutation, then all_to_all_single back with the splits swapped

Soft MoE's slots are the same number for every expert, so its bank exchanges even splits and no counts.
Transport is torch.distributed's `all_to_all_single` (gloo on CPU, NCCL on GPU); `ops.collectives.AllToAll` only
makes it differentiable. Every rank runs every collective, also with no rows, or the job would hang.

Two groups, which differ on a 2-D mesh (`moespec.distributed.parallelize`): `group`, the expert-parallel ranks
the rows travel over, and `stats`, every rank whose batch is a slice of the global batch: the aux losses and
routing statistics sum over it, so that they equal those of one process on the whole batch (None: this
process's own, as in one process or under a plain DistributedDataParallel).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..ops.collectives import AllToAll as Exchange
from ..ops.collectives import ScaleGrad
from ..ops.mode import Mode
from .rows import Segments


class Local:
    """The bank holds every expert: the rows go straight to its step."""

    local = True  # the rows stay on this rank: a step may fuse the gather and the combine around its matmuls
    group = None  # no rows travel
    first = 0

    def __init__(self, stats: dist.ProcessGroup | None = None):
        self.stats = stats  # where aux losses and routing statistics sum (None: this process's own)

    def run(self, bank, x: torch.Tensor, segments: Segments, groups: torch.Tensor | None, mode: Mode,
            step: str | None = None) -> torch.Tensor:
        """[S, C'] the bank's experts on rows x [S, C] sorted by expert, through `step` (None: the chooser's)."""
        return bank.run_local(x, segments, groups, mode, step)

    def batched(self, bank, x: torch.Tensor, mode: Mode) -> torch.Tensor:
        """Expert e on every row of x[e] (x [E, M, C])."""
        return bank.run_slots(x, mode)

    def parameters(self, params: list) -> list:
        return params

    def __repr__(self) -> str:
        return "Local()" if self.stats is None else f"Local(statistics over {dist.get_world_size(self.stats)} ranks)"


LOCAL = Local()


class AllToAll(Local):
    """Rows travel to the rank that holds their expert over `group` and back (the module docstring's steps).
    `first`: the global index of this rank's first expert; `stats`: the ranks whose batches make the global
    batch (default: every rank); `replicas`: the ranks that hold the same experts (one per expert-parallel group;
    None where the group spans every rank), over which their gradients are averaged
    (`moespec.distributed.replicas`), as the replicated weights' are."""

    local = False

    def __init__(self, group: dist.ProcessGroup, first: int, stats: dist.ProcessGroup | None = None,
                 replicas: dist.ProcessGroup | None = None):
        super().__init__(stats if stats is not None else group)
        self.group, self.first, self.replicas = group, first, replicas
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.check = None  # called with the bank before each exchange: refuses a wrapping that mixes experts

    def run(self, bank, x: torch.Tensor, segments: Segments, groups: torch.Tensor | None, mode: Mode,
            step: str | None = None) -> torch.Tensor:
        """Rows `x` [S, C] sorted by global expert (`segments`: counts [E]); returns their expert outputs [S, C']
        in the same order, computed on the ranks that hold the experts; dropped rows stay here with output 0.
        The received rows choose their own step (`step`, chosen for the rows sent, does not apply to them)."""
        if self.check is not None:
            self.check(bank)
        world, local = self.world, bank.local_experts
        counts = segments.counts
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [W * L]: from each rank, per local expert
        # the layer's one host sync: the split sizes must be on the host to size the receive buffers
        send, recv = torch.stack([counts.view(world, local).sum(1), received.view(world, local).sum(1)]).tolist()
        rows_in = x.shape[0]
        x, groups = x[:sum(send)], groups[:sum(send)] if groups is not None else None  # the dropped rows stay
        rows = Exchange.apply(x, recv, send, self.group)
        order, local_counts = expert_major(received.view(world, local), rows.shape[0])
        local_groups = None
        if groups is not None:  # image ids made unique over the ranks: GRN normalizes per image
            source = torch.repeat_interleave(torch.arange(world, device=x.device), torch.tensor(recv, device=x.device),
                                             output_size=rows.shape[0])
            theirs = x.new_empty(rows.shape[0], dtype=groups.dtype)
            dist.all_to_all_single(theirs, groups.contiguous(), recv, send, group=self.group)
            local_groups = torch.unique(source * (1 << 32) + theirs, return_inverse=True)[1][order]
        out = bank.run_local(rows[order], Segments(local_counts), local_groups, mode)
        if rows.shape[0] == 0:
            # no rows here: the rows and every local expert still join the graph (with zero gradients), so
            # that backward runs this rank's half of the return exchange as the other ranks do theirs, and
            # the experts get the zero gradient that one process gives them
            out = out + (rows.sum() + sum(p.sum() for p in bank.parameters())) * 0
        back = out.new_empty(out.shape).index_copy(0, order, out)  # expert-major -> rank-major
        back = Exchange.apply(back, send, recv, self.group)
        return torch.cat([back, back.new_zeros(rows_in - back.shape[0], back.shape[-1])])

    def batched(self, bank, x: torch.Tensor, mode: Mode) -> torch.Tensor:
        """Expert e on every row of x[e], x [E, M, C] with the same M on every rank (Soft MoE's slots): even
        splits, no counts exchange."""
        if self.check is not None:
            self.check(bank)
        world, local = self.world, bank.local_experts
        experts, slots, dim = x.shape
        splits = [local * slots] * world
        rows = Exchange.apply(x.reshape(experts * slots, dim), splits, splits, self.group)
        rows = rows.view(world, local, slots, dim).transpose(0, 1).reshape(local, world * slots, dim)
        out = bank.run_slots(rows, mode)
        width = out.shape[-1]  # named, not -1: a batch of 0 images has 0 slots per expert
        out = out.view(local, world, slots, width).transpose(0, 1).reshape(experts * slots, width)
        return Exchange.apply(out, splits, splits, self.group).view(experts, slots, width)

    def parameters(self, params: list) -> list:
        """The local experts' weights, their gradients divided by W: each rank's loss is a mean over its own
        batch, and these weights see every rank's rows, so that the gradient equals one process's on the
        whole batch (replicated weights get the same 1/W from DistributedDataParallel's average)."""
        return [None if p is None else ScaleGrad.apply(p, 1.0 / self.world) for p in params]

    def __repr__(self) -> str:
        replicas = f", {dist.get_world_size(self.replicas)} replicas" if self.replicas is not None else ""
        return f"AllToAll(rank {self.rank} of {self.world}, first expert {self.first}{replicas})"


def shard_bank(bank: nn.Module, group: dist.ProcessGroup, stats: dist.ProcessGroup | None = None,
               replicas: dist.ProcessGroup | None = None) -> nn.Module:
    """Keep only this rank's experts [first, first + E/W) of `bank` (in place; its stacked parameters sliced
    and copied, so that the whole ones can be freed; its buffers, the same for every expert, whole) and send
    its rows over `group` (`AllToAll`, with `stats` and `replicas`). `num_experts` stays the global E, what the
    layer routes to."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local = bank.num_experts // world
    first = rank * local
    for name, source in list(bank.named_parameters()):
        module, _, attr = name.rpartition(".")
        piece = source.detach()[first: first + local].clone()
        setattr(bank.get_submodule(module), attr, nn.Parameter(piece, requires_grad=source.requires_grad))
    bank.transport = AllToAll(group, first, stats, replicas)
    return bank


def sharded_banks(model: nn.Module) -> dict[str, nn.Module]:
    """The expert banks of a model whose rows travel over ranks, by qualified name."""
    return {name: m for name, m in model.named_modules() if not getattr(m, "transport", LOCAL).local}


def expert_major(counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For `total` rows received rank-major (`counts` [W, L]: rows from rank s for local expert e, segments in
    (s, e) order): the order [R] that puts them expert-major ((e, s) order), and the rows per local expert [L]."""
    lengths = counts.reshape(-1)
    starts = torch.cumsum(lengths, 0) - lengths  # where segment (s, e) starts, rank-major
    by_expert = counts.t().reshape(-1)
    starts = starts.view_as(counts).t().reshape(-1)
    segment = torch.repeat_interleave(torch.arange(by_expert.numel(), device=counts.device), by_expert,
                                      output_size=total)
    offset = torch.arange(segment.numel(), device=counts.device) - (torch.cumsum(by_expert, 0) - by_expert)[segment]
    return starts[segment] + offset, counts.sum(0)

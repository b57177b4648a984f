"""Expert parallelism: an `Experts` bank whose experts are spread over the ranks of a process group.

Rank r of W holds experts [r * E/W, (r+1) * E/W) of every sharded bank; the rest of the model is replicated.
The bank keeps `Experts`' call signature, so the MoE layers do not change (`moespec.distributed.shard_experts`
swaps the banks in). One forward of a token-choice bank (rows sorted by global expert, `counts` [E]):

    counts exchange     all_to_all_single of the [E] counts: each rank learns how many rows it will receive
    dispatch            all_to_all_single of the rows, variable splits (rank-major: source rank, then expert)
    permute             rank-major -> expert-major, so that each local expert has one contiguous segment
    local experts       `Experts.forward` on the E/W local experts (loop, padded or grouped_mm)
    un-permute, return  the inverse permutation, then all_to_all_single back with the splits swapped

Soft MoE's slots are the same number for every expert, so its bank exchanges even splits and no counts.
Transport is torch.distributed's `all_to_all_single` (gloo on CPU, NCCL on GPU); `AllToAll` only makes it
differentiable. Every rank runs every collective, also with no rows, or the job would hang.

The aux losses and routing statistics of a sharded layer sum their statistics over the group
(`collectives.all_reduce_sum`), so that they equal those of one process on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .collectives import AllToAll, ScaleGrad
from .experts import Experts


class ExpertParallel(Experts):
    """The experts [first, first + E/W) of an E-expert bank, on this rank of `group`; same call signature as
    `Experts`, which it is for the local experts. `num_experts` is the global E (what the layer routes to).

    Build it from a whole bank with `ExpertParallel.shard(bank, group)`.
    """

    group: dist.ProcessGroup
    world: int
    rank: int

    @classmethod
    def shard(cls, bank: Experts, group: dist.ProcessGroup) -> "ExpertParallel":
        """This rank's slice of `bank` (parameters copied, so that the whole bank can be freed; free on the
        meta device)."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        local = bank.num_experts // world
        norm_eps = bank.norm.eps if bank.norm is not None else 1e-6
        with torch.device("meta"):
            shard = cls(local, bank.in_features, bank.hidden, bank.out_features, act=bank.act, glu=bank.glu,
                        inner_norm=bank.inner_norm, norm_eps=norm_eps,
                        bias=(bank.fc1.bias is not None, bank.fc2.bias is not None), drop=bank.drop,
                        clamped=bank.clamp is not None)
        first = rank * local
        for (name, _), (_, source) in zip(shard.named_parameters(), bank.named_parameters(), strict=True):
            module, attr = name.rsplit(".", 1)
            piece = source.detach()[first: first + local].clone()
            setattr(shard.get_submodule(module), attr, nn.Parameter(piece, requires_grad=source.requires_grad))
        for name, buffer in bank.named_buffers():  # the same for every expert: whole on every rank
            shard.get_submodule(name.rpartition(".")[0]).register_buffer(name.rpartition(".")[2], buffer.clone())
        shard.step = bank.step
        shard.num_experts, shard.first, shard.group, shard.world, shard.rank = bank.num_experts, first, group, \
            world, rank
        return shard

    def forward(self, x: torch.Tensor, counts: torch.Tensor, groups: torch.Tensor | None = None, *,
                tail: bool = False, step: str | None = None) -> torch.Tensor:
        """Rows `x` [S, C] sorted by global expert, `counts` [E]; returns their expert outputs [S, C'] in the
        same order, computed on the ranks that hold the experts (0 for the `tail` rows past sum(counts)). `step`
        (chosen for these rows) applies on a world of one; elsewhere the received rows choose their own."""
        world, local = self.world, self.local_experts
        if world == 1:  # nothing to exchange: the bank itself, without the exchange's host sync
            return super().forward(x, counts, groups, tail=tail, step=step)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [W * L]: from each rank, per local expert
        # the layer's one host sync: the split sizes must be on the host to size the receive buffers
        send, recv = torch.stack([counts.view(world, local).sum(1), received.view(world, local).sum(1)]).tolist()
        rows_in = x.shape[0]
        if tail:  # the pairs left out stay here, with output 0
            x, groups = x[:sum(send)], groups[:sum(send)] if groups is not None else None
        rows = AllToAll.apply(x, recv, send, self.group)
        order, local_counts = expert_major(received.view(world, local), rows.shape[0])
        local_groups = None
        if groups is not None:  # image ids made unique over the ranks: GRN normalizes per image
            source = torch.repeat_interleave(torch.arange(world, device=x.device), torch.tensor(recv, device=x.device),
                                             output_size=rows.shape[0])
            theirs = x.new_empty(rows.shape[0], dtype=groups.dtype)
            dist.all_to_all_single(theirs, groups.contiguous(), recv, send, group=self.group)
            local_groups = torch.unique(source * (1 << 32) + theirs, return_inverse=True)[1][order]
        out = super().forward(rows[order], local_counts, local_groups)
        if rows.shape[0] == 0:
            # no rows here: the rows and every local expert still join the graph (with zero gradients), so
            # that backward runs this rank's half of the return exchange as the other ranks do theirs, and
            # the experts get the zero gradient that one process gives them
            out = out + (rows.sum() + sum(p.sum() for p in self.parameters())) * 0
        back = out.new_empty(out.shape).index_copy(0, order, out)  # expert-major -> rank-major
        back = AllToAll.apply(back, send, recv, self.group)
        return torch.cat([back, back.new_zeros(rows_in - back.shape[0], back.shape[-1])]) if tail else back

    @property
    def routing_group(self) -> dist.ProcessGroup | None:
        """The group the MoE layer sums its aux losses and routing statistics over: None on a world of one,
        where those sums are the process's own (no collective)."""
        return self.group if self.world > 1 else None

    @property
    def gathers_pairs(self) -> bool:
        """On a world of one the bank is the whole bank: the fused gather and combine of `Experts` (elsewhere the
        rows travel to other ranks, `forward`)."""
        return self.world == 1

    def runs_segmentwise(self, items: torch.Tensor) -> bool:
        """Only on a world of one: elsewhere the rows are gathered and sent to the ranks that hold their experts
        (`forward`)."""
        return self.world == 1 and super().runs_segmentwise(items)

    def batched(self, x: torch.Tensor) -> torch.Tensor:
        """Expert e on every row of x[e], x [E, M, C] with the same M on every rank (Soft MoE's slots): even
        splits, no counts exchange."""
        world, local = self.world, self.local_experts
        if world == 1:
            return self._equal_segments(x)
        experts, slots, dim = x.shape
        splits = [local * slots] * world
        rows = AllToAll.apply(x.reshape(experts * slots, dim), splits, splits, self.group)
        rows = rows.view(world, local, slots, dim).transpose(0, 1).reshape(local, world * slots, dim)
        out = self._equal_segments(rows)
        width = out.shape[-1]  # named, not -1: a batch of 0 images has 0 slots per expert
        out = out.view(local, world, slots, width).transpose(0, 1).reshape(experts * slots, width)
        return AllToAll.apply(out, splits, splits, self.group).view(experts, slots, width)

    def forward_all(self, x: torch.Tensor, groups: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError("shared experts are replicated, never sharded")

    def _param_list(self) -> list[torch.Tensor | None]:
        """The local experts' weights, their gradients divided by W: each rank's loss is a mean over its own
        batch, and these weights see every rank's rows, so that the gradient equals one process's on the
        whole batch (replicated weights get the same 1/W from DistributedDataParallel's average)."""
        if self.world == 1:
            return super()._param_list()
        return [None if p is None else ScaleGrad.apply(p, 1.0 / self.world) for p in super()._param_list()]

    def extra_repr(self) -> str:
        return f"experts {self.first}..{self.first + self.local_experts - 1} of {self.num_experts}, rank " \
               f"{self.rank} of {self.world}"


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


def sharded_banks(model: nn.Module) -> dict[str, ExpertParallel]:
    """The sharded expert banks of a model, by qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, ExpertParallel)}


"""The experts' gradients averaged over their replicas: with expert-parallel groups smaller than the world,
rank r of every group holds the same experts, and each replica's gradient comes from its group's slice of the
batch. DistributedDataParallel leaves the experts out (`shard_experts`), so this averages them, as DDP does the
replicated weights, once at the end of each backward.

The average runs in a callback queued on autograd's engine by the first expert gradient of a backward
(DistributedDataParallel finalizes its buckets the same way): after every expert-parallel exchange of that
backward, in one all-reduce of every bank's gradients in model order, so that the ranks can never wait on
each other in different orders. Under gradient accumulation it averages each micro-batch's gradients: the sum
of the averages is the average of the sums. Banks sharded by FSDP2 (`parallelize(..., data="fsdp")`) hold
FSDP's parameters, not these, so the hooks never fire there: FSDP's reduce-scatter averages them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class ReplicaMean:
    """Averages the gradients of `params` over `group` after every backward that reaches them (also what
    `parallelize` does for the scalar parameters FSDP2 cannot shard, such as Soft MoE's scale)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup):
        self.params = [p for p in params if p.requires_grad]
        self.group, self.queued = group, False
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._reached)

    def _reached(self, _param: torch.Tensor) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.average)

    @torch.no_grad()
    def average(self) -> None:
        """Every bank's gradients averaged over the replicas, in one collective."""
        self.queued = False
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= dist.get_world_size(self.group)
        start = 0
        for grad in grads:
            grad.copy_(flat[start: start + grad.numel()].view_as(grad))
            start += grad.numel()

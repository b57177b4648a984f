"""The two collectives of expert parallelism, made differentiable: torch.distributed moves the bytes, these
functions only say how gradients flow back."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


class AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` with variable splits, differentiable: backward sends the gradients back the
    way the rows came, with the split sizes swapped (Megatron-LM's `_AllToAll`, DeepSpeed's `_AllToAll`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (list(output_splits), list(input_splits)), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(output_splits), list(input_splits), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        grad_in = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad_in, None, None, None


class ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by `scale` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def all_reduce_sum(tensors: Sequence[torch.Tensor], group) -> list[torch.Tensor]:
    """Each tensor summed over `group`'s W ranks (as it is, without a group), in one collective, in float64 (so
    that counts stay exact).

    The gradient is this rank's own part times W, with no collective in backward: every rank computes the same
    function f of the same sums S, so the gradient of one process on the whole batch, f'(S) * sum_r dS_r, is
    the mean over the ranks of f'(S) * W * dS_r, which is what DistributedDataParallel's gradient averaging
    makes of it. (A collective in backward could run in a different order on different ranks, where the
    autograd graphs differ, and hang.)
    """
    if group is None:
        return list(tensors)
    world = dist.get_world_size(group)
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    dist.all_reduce(flat, group=group)
    out, start = [], 0
    for t in tensors:
        total = flat[start: start + t.numel()].reshape(t.shape).to(t.dtype)
        if t.requires_grad:  # the value of the sum, the gradient of W times this rank's part
            total = total + world * (t - t.detach())
        out.append(total)
        start += t.numel()
    return out

"""Gradient clipping by the norm of the whole model's gradient, experts of every rank included."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .sharding import expert_group, expert_parameters


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over every parameter of an expert-parallel model: the norm counts the
    replicated gradients once and every rank's expert gradients, so that every rank clips by the same factor
    (otherwise the replicated routers would drift apart) and the result equals one process's. Returns the
    total norm. A collective: call it on every rank. Works on an unsharded model too (as torch's)."""
    experts, replicated = expert_parameters(model)
    group = expert_group(model)
    norm_type = float(norm_type)
    grads = [p.grad for p in experts + replicated if p.grad is not None]
    like = _local(grads[0] if grads else next(model.parameters()))  # device and dtype of the norms
    local = _norm([p.grad for p in experts if p.grad is not None], norm_type, like)
    shared = _norm([p.grad for p in replicated if p.grad is not None], norm_type, like)
    if group is not None:  # the experts' part of the norm, from every rank
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        if not math.isinf(norm_type):
            local = local ** norm_type
        dist.all_reduce(local, op=op, group=group)
        if not math.isinf(norm_type):
            local = local ** (1.0 / norm_type)
    total = torch.maximum(local, shared) if math.isinf(norm_type) else \
        torch.linalg.vector_norm(torch.stack([local, shared]), norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(coefficient)  # FSDP2's: its own shard
    return total


def _norm(grads: list[torch.Tensor], norm_type: float, like: torch.Tensor) -> torch.Tensor:
    """The norm of the gradients taken together (0 for none), on `like`'s device and in its dtype."""
    if not grads:
        return like.new_zeros(())
    norms = [_whole(torch.linalg.vector_norm(g, norm_type)).to(like.device, like.dtype) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """The norm of an FSDP2-sharded gradient over all its shards (a collective); a plain one as it is."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm

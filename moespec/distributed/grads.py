"""Gradient clipping by the norm of the whole model's gradient, experts of every rank included."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import MoespecError
from .sharding import expert_group, expert_parameters


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over every parameter of an expert-parallel model: the norm counts the
    replicated gradients once and every rank's expert gradients, so that every rank clips by the same factor
    (otherwise the replicated routers would drift apart) and the result equals one process's. Returns the
    total norm. A collective: call it on every rank. Works on an unsharded model too (as torch's), under DDP, and
    under FSDP2 (`parallelize`): a sharded gradient counts this rank's shard, combined over its mesh in one
    collective a mesh, and each rank scales its own shard."""
    experts, replicated = expert_parameters(model)
    group = expert_group(model)
    norm_type = float(norm_type)
    grads = [p.grad for p in experts + replicated if p.grad is not None]
    like = _local(grads[0] if grads else next(model.parameters()))  # device and dtype of the norms
    local = _norm([p.grad for p in experts if p.grad is not None], norm_type, like)
    shared = _norm([p.grad for p in replicated if p.grad is not None], norm_type, like)
    if group is not None:  # the experts' part of the norm, from every rank
        local = _combine(local, norm_type, group)
    total = torch.maximum(local, shared) if math.isinf(norm_type) else \
        torch.linalg.vector_norm(torch.stack([local, shared]), norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        _local(grad).mul_(coefficient)
    return total


def _norm(grads: list[torch.Tensor], norm_type: float, like: torch.Tensor) -> torch.Tensor:
    """The norm of the gradients taken together (0 for none), on `like`'s device and in its dtype. A DTensor
    gradient (FSDP2's: sharded on dim 0 over its mesh) counts this rank's shard, combined over its mesh."""
    plain = [g for g in grads if not isinstance(g, DTensor)]
    shards: dict = {}  # mesh -> this rank's shards (every rank meets the meshes in the model's order)
    for grad in grads:
        if isinstance(grad, DTensor):
            if grad.device_mesh.ndim != 1 or not grad.placements[0].is_shard():
                raise MoespecError(f"clip_grad_norm_: a gradient is a DTensor placed {grad.placements} over "
                                   f"{grad.device_mesh}; only FSDP2's 1-D shards are counted (parallelize)")
            shards.setdefault(grad.device_mesh, []).append(grad.to_local())
    norms = [_local_norm(plain, norm_type, like)]
    norms += [_combine(_local_norm(local, norm_type, like), norm_type, mesh.get_group())
              for mesh, local in shards.items()]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def _local_norm(grads: list[torch.Tensor], norm_type: float, like: torch.Tensor) -> torch.Tensor:
    """The norm of plain tensors taken together; 0 for none or for empty ones (an inf norm has no identity)."""
    norms = [torch.linalg.vector_norm(g, norm_type).to(like.device, like.dtype) for g in grads if g.numel()]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else like.new_zeros(())


def _combine(norm: torch.Tensor, norm_type: float, group: dist.ProcessGroup) -> torch.Tensor:
    """The norm over `group` of each rank's part `norm` (a collective)."""
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    norm = norm ** norm_type
    dist.all_reduce(norm, group=group)
    return norm ** (1.0 / norm_type)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t

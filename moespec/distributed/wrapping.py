"""Wrappings that would shard the experts twice are refused at the forward, before any exchange.

A bank sharded by `shard_experts` holds this rank's experts. FSDP2's `fully_shard` of a module around it treats
them as a replicated weight: it keeps 1/N of each rank's tensor and all-gathers the pieces, which mixes
different ranks' experts into one wrong tensor of the right shape (no error, a wrong loss). So before each
exchange the bank's transport checks where it stands: under an FSDP2 module, the bank must either keep the
parameters shard_experts gave it (fully_shard was given them as `ignored_params`) or be sharded by FSDP2
itself over its replicas' ranks (what `parallelize(..., data="fsdp")` does, as torchtitan gives experts
their own mesh). Anything else is one MoespecError on every rank that names `parallelize`.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..errors import MoespecError

ADVICE = ("use moespec.distributed.parallelize(model, mesh, data='fsdp'), which shards the rest with FSDP2 and the "
          "experts over their replicas, or pass the experts to fully_shard as ignored_params")


class WrappingCheck:
    """The check of one bank at `path` in `model` (module docstring)."""

    def __init__(self, model: nn.Module, path: str, bank: nn.Module):
        self.model, self.path = weakref.ref(model), path
        self.own = [weakref.ref(p) for p in bank.parameters()]
        replicas = bank.transport.replicas
        self.replica_ranks = sorted(dist.get_process_group_ranks(replicas)) if replicas is not None else \
            [dist.get_rank()]

    def __call__(self, bank: nn.Module) -> None:
        if isinstance(bank, FSDPModule):
            ranks = _mesh_ranks(bank)
            if ranks is not None and ranks != self.replica_ranks:
                raise MoespecError(f"{self.path}: its experts are sharded over ranks (shard_experts), and fully_shard "
                                   f"shards them again over ranks {ranks}, which hold other experts; FSDP may shard "
                                   f"them only over their replicas, ranks {self.replica_ranks}: {ADVICE}")
            return
        model = self.model()
        if model is None or not self._under_fsdp(model):
            return
        if any(own() is not param for own, param in zip(self.own, bank.parameters(), strict=False)):
            raise MoespecError(f"{self.path}: its experts are sharded over ranks (shard_experts), and a fully_shard "
                               f"around them shards them again as if every rank held the same experts, which mixes "
                               f"different ranks' experts into wrong weights: {ADVICE}")

    def _under_fsdp(self, model: nn.Module) -> bool:
        parts = self.path.split(".")
        module = model
        for part in parts[:-1]:
            if isinstance(module, FSDPModule):
                return True
            module = getattr(module, part, None)
            if module is None:
                return False
        return isinstance(module, FSDPModule)


def _mesh_ranks(module: FSDPModule) -> list[int] | None:
    """The global ranks of the mesh FSDP2 shards `module` over (None where this torch does not say)."""
    try:
        mesh = module._get_fsdp_state()._fsdp_param_group.mesh_info.mesh
    except AttributeError:
        return None
    return sorted(int(rank) for rank in mesh.mesh.flatten().tolist())

"""Spreading a compiled model's experts over the ranks of a process group, in place.

After `shard_experts(model, group)`, rank r of an expert-parallel group of W ranks holds experts
[r * E/W, (r+1) * E/W) of every MoE layer (a bank's stacked parameters sliced, and its rows sent over the
group by its transport, `layers/steps/transport.py`; the state-dict names stay). The group may be every rank,
or one of equal subgroups that split the world (a 2-D mesh's `ep` dim): the experts are then replicated over
the groups, rank r of each group holding the same ones. Everything else stays replicated: wrap the model in
DistributedDataParallel as usual, which leaves the expert parameters out (they differ per rank; averaging them
would mix different experts). Their gradients are divided by W as they are computed
(`transport.AllToAll.parameters`), and averaged over their replicas after each backward (`replicas.py`), so
that they equal one process's on the whole batch when the loss is a mean over each rank's batch. The aux
losses and routing statistics sum over every rank.
"""

from __future__ import annotations

import hashlib

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..compiler import moe_layers
from ..errors import MoespecError
from ..layers.steps.transport import shard_bank, sharded_banks
from ..planning.ranks import uneven_experts
from .replicas import ReplicaMean
from .wrapping import WrappingCheck


def shard_experts(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Keep only this rank's experts of every MoE layer of `model` (in place; returns `model`).

    A collective: every rank calls it, with the same spec (checked by its hash) and its own expert-parallel
    `group` (default: all ranks): every rank's group has the same size W, each rank is in one, and W divides
    every layer's experts. With groups smaller than the world, rank r of each group holds the same experts,
    whose gradients are averaged over those replicas after every backward. Call it before building the
    optimizer, whose parameters it replaces. For FSDP2, or DDP over a 2-D mesh in one call, see `parallelize`.
    """
    return shard_over(model, group, average_replicas=True)


def shard_over(model: nn.Module, group: dist.ProcessGroup | None, *, average_replicas: bool) -> nn.Module:
    """`shard_experts`; `average_replicas=False` leaves the replicas' gradients to FSDP (`parallelize`)."""
    require_process_group("shard_experts")
    if sharded_banks(model):
        raise MoespecError("shard_experts: this model's experts are already sharded (it was called twice)")
    spec = getattr(model, "moespec_spec", None)
    if spec is None:
        raise MoespecError("shard_experts: this model was not built by moespec (no spec attached); build it with "
                           "moespec.create_model, moespec.load or moespec.distributed.load (and shard it before "
                           "wrapping it in DDP or FSDP)")
    _check_same_spec(spec)
    groups = expert_parallel_groups(group or dist.group.WORLD)
    world = len(groups[0])
    check_divisible({path: layer.experts.num_experts for path, layer in moe_layers(model).items()}, world,
                    "shard_experts")
    # every rank creates every group, in the same order (torch.distributed's rule for new_group): the experts'
    # traffic on its own communicator, apart from DDP's all-reduces; the replicas' gradient averages on theirs
    traffic = _own(groups)
    replicas = _own([[ranks[i] for ranks in groups] for i in range(world)]) if len(groups) > 1 else None
    ignored = []
    for path, layer in moe_layers(model).items():
        shard_bank(layer.experts, traffic, dist.group.WORLD, replicas)
        layer.experts.transport.check = WrappingCheck(model, f"{path}.experts", layer.experts)
        ignored += [f"{path}.experts.{name}" for name, _ in layer.experts.named_parameters()]
    if replicas is not None and average_replicas:
        ReplicaMean([p for bank in sharded_banks(model).values() for p in bank.parameters()], replicas)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return model


def expert_parallel_groups(group: dist.ProcessGroup) -> list[list[int]]:
    """Every rank's expert-parallel group (global ranks), gathered from all ranks and checked: groups of one
    size that split the world, each rank in one. Sorted by first rank; a collective."""
    mine = sorted(dist.get_process_group_ranks(group))
    every: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    groups = sorted({tuple(ranks) for ranks in every})
    sizes = {len(ranks) for ranks in groups}
    covered = sorted(rank for ranks in groups for rank in ranks)
    if len(sizes) > 1 or covered != list(range(dist.get_world_size())):
        shown = "; ".join(f"rank {rank}: {ranks}" for rank, ranks in enumerate(every))
        raise MoespecError(f"shard_experts: the ranks' groups must be of one size and hold each rank once ({shown}); "
                           f"pass each rank its row of a DeviceMesh's ep dim, mesh['ep'].get_group(), or use "
                           f"moespec.distributed.parallelize(model, mesh)")
    return [list(ranks) for ranks in groups]


def _own(groups: list[list[int]]) -> dist.ProcessGroup:
    """A process group for each of `groups` (every rank makes every one, in the same order: torch.distributed's
    rule for new_group); returns the one this rank is in."""
    made = [dist.new_group(ranks) for ranks in groups]
    return next(group for group, ranks in zip(made, groups, strict=True) if dist.get_rank() in ranks)


def require_process_group(what: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise MoespecError(f"{what} needs an initialized process group: call torch.distributed.init_process_group() "
                           f"first (and run the script under torchrun)")


def check_divisible(experts: dict[str, int], world: int, what: str) -> None:
    """Every MoE layer's experts (`experts`: layer path -> E) must split evenly over `world` ranks."""
    problem = uneven_experts(experts, world)
    if problem is not None:
        raise MoespecError(f"{what}: {problem}")


def _check_same_spec(spec) -> None:
    """Every rank must hold the model of the same spec, or the collectives would mismatch and hang."""
    digest = hashlib.sha256(spec.to_yaml().encode()).hexdigest()
    digests: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        ranks = ", ".join(f"rank {rank}: {d[:12]}" for rank, d in enumerate(digests))
        raise MoespecError(f"shard_experts: the ranks hold models of different specs (sha256 of the spec {ranks}); "
                           f"every rank must build the same spec")


def expert_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The process group a model's experts are sharded over (None if they are not)."""
    banks = sharded_banks(model)
    return next(iter(banks.values())).transport.group if banks else None


def expert_banks(model: nn.Module) -> dict[str, nn.Module]:
    """This rank's expert banks by qualified name: `bank.first` .. `bank.first + bank.local_experts - 1` of
    `bank.num_experts` experts."""
    return sharded_banks(model)


def expert_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(this rank's expert parameters, the replicated ones), each parameter once."""
    experts = {id(p) for bank in sharded_banks(model).values() for p in bank.parameters()}
    params = list(model.parameters())
    return [p for p in params if id(p) in experts], [p for p in params if id(p) not in experts]


def expert_slices(model: nn.Module) -> dict[str, slice]:
    """State-dict name -> this rank's slice of the expert axis, for every sharded expert tensor."""
    found = {}
    for prefix, bank in sharded_banks(model).items():
        for name, _ in bank.named_parameters():
            found[f"{prefix}.{name}"] = slice(bank.first, bank.first + bank.local_experts)
    return found

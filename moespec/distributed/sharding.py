"""Spreading a compiled model's experts over the ranks of a process group, in place.

After `shard_experts(model)`, rank r of W holds experts [r * E/W, (r+1) * E/W) of every MoE layer (an
bank's stacked parameters sliced, and its rows sent over the ranks by its transport, `layers/steps/transport.py`; the
state-dict names stay). Everything else stays
replicated: wrap the model in DistributedDataParallel as usual, which leaves the expert parameters out (they
differ per rank; averaging them would mix different experts). Their gradients are divided by W as they are
computed (`transport.AllToAll.parameters`), so that they equal one process's on the whole batch when the loss is
a mean over each rank's batch.
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


def shard_experts(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Keep only this rank's experts of every MoE layer of `model` (in place; returns `model`).

    A collective: every rank of `group` (default: all ranks) calls it with the same spec, checked by its hash.
    Call it before building the optimizer, whose parameters it replaces. `group` must span every rank: experts
    replicated over several expert-parallel groups (expert data parallelism) are not supported yet.
    """
    require_process_group("shard_experts")
    if sharded_banks(model):
        raise MoespecError("shard_experts: this model's experts are already sharded (it was called twice)")
    spec = getattr(model, "moespec_spec", None)
    if spec is None:
        raise MoespecError("shard_experts: this model was not built by moespec (no spec attached); build it with "
                           "moespec.create_model, moespec.load or moespec.distributed.load")
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    if world != dist.get_world_size():
        raise MoespecError(f"shard_experts: the group has {world} of the {dist.get_world_size()} ranks; expert "
                           f"parallelism over a subgroup (expert data parallelism) is not supported yet")
    _check_same_spec(spec, group)
    check_divisible({path: layer.experts.num_experts for path, layer in moe_layers(model).items()}, world,
                    "shard_experts")
    # the experts' traffic gets its own communicator, apart from DDP's gradient all-reduces on the world group
    traffic = dist.new_group(dist.get_process_group_ranks(group))
    ignored = []
    for path, layer in moe_layers(model).items():
        shard_bank(layer.experts, traffic)
        ignored += [f"{path}.experts.{name}" for name, _ in layer.experts.named_parameters()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return model


def require_process_group(what: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise MoespecError(f"{what} needs an initialized process group: call torch.distributed.init_process_group() "
                           f"first (and run the script under torchrun)")


def check_divisible(experts: dict[str, int], world: int, what: str) -> None:
    """Every MoE layer's experts (`experts`: layer path -> E) must split evenly over `world` ranks."""
    problem = uneven_experts(experts, world)
    if problem is not None:
        raise MoespecError(f"{what}: {problem}")


def _check_same_spec(spec, group: dist.ProcessGroup) -> None:
    """Every rank must hold the model of the same spec, or the collectives would mismatch and hang."""
    digest = hashlib.sha256(spec.to_yaml().encode()).hexdigest()
    digests: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
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

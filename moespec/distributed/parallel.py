"""One call lays a model out on a 2-D device mesh of data and expert parallelism, as torchtitan does
(`torchtitan/distributed/parallel_dims.py`, `distributed/fsdp.py`).

    mesh = init_device_mesh("cuda", (dp, ep), mesh_dim_names=("dp", "ep"))
    model = moespec.distributed.parallelize(model, mesh, data="fsdp")  # or data="ddp"

Every one of the dp * ep ranks trains its own slice of the global batch. What each axis holds:

    ep   the experts: each rank of an `ep` row keeps E/ep of every layer's experts (`shard_experts`), and
         the tokens travel to them and back over the row (two all-to-alls a layer, each way)
    dp   the experts' replicas: rank i of every `ep` row holds the same experts; their gradients are averaged
         over the `dp` column (DDP: one all-reduce after backward, `replicas.py`; FSDP: FSDP2 shards the
         banks over the column, each its own module, and reduce-scatters them)
    all  the rest (attention, norms, routers, shared experts, the head) is replicated over every rank, its
         gradients averaged over all dp * ep ranks (DDP), or sharded over all of them (FSDP2's fully_shard
         of each block and of the root, over the mesh flattened)

The aux losses, routing statistics and balancing-bias loads sum over every rank, so that the model computes
what one process computes on the whole batch.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.nn.parallel import DistributedDataParallel

from ..compiler import moe_layers
from ..errors import MoespecError
from ..layers.steps.transport import Local, sharded_banks
from .replicas import ReplicaMean
from .sharding import expert_group, require_process_group, shard_over

DATA = ("ddp", "fsdp")
BANK_ENTRIES = ("combine", "batched")  # the bank methods its layer calls: FSDP2 unshards around them


def parallelize(model: nn.Module, mesh: DeviceMesh, data: str = "fsdp") -> nn.Module:
    """Expert parallelism over `mesh["ep"]` and data parallelism (`data`: "ddp" or "fsdp") over the rest, on a
    `DeviceMesh` whose dims are named `dp` and `ep` (either may be 1; the module docstring says what each
    holds). A collective: every rank calls it with the same spec. The model is the one moespec built, or one
    whose experts `moespec.distributed.load` / `upcycle` read already sharded over `mesh["ep"]` (`group=`).
    Returns the model to train, build the optimizer from (a DistributedDataParallel for "ddp"; the model
    itself, sharded in place, for "fsdp")."""
    require_process_group("parallelize")
    if data not in DATA:
        raise MoespecError(f"parallelize: data={data!r}; allowed: {', '.join(map(repr, DATA))}")
    names = tuple(mesh.mesh_dim_names or ())
    if sorted(names) != ["dp", "ep"]:
        raise MoespecError(f"parallelize: the mesh's dims are named {names or 'nothing'}; it needs two, named 'dp' "
                           f"and 'ep' (either may be of size 1): init_device_mesh(device, (dp, ep), "
                           f"mesh_dim_names=('dp', 'ep'))")
    if mesh.size() != dist.get_world_size():
        raise MoespecError(f"parallelize: the mesh holds {mesh.size()} of the {dist.get_world_size()} ranks; it must "
                           f"hold every rank")
    if isinstance(model, (DistributedDataParallel, FSDPModule)) or any(isinstance(m, FSDPModule)
                                                                       for m in model.modules()):
        raise MoespecError("parallelize: the model is already wrapped (DDP or fully_shard); give parallelize the model "
                           "moespec built, before any wrapping")
    dp, ep = mesh["dp"], mesh["ep"]
    fsdp = data == "fsdp"
    if sharded_banks(model):  # by moespec.distributed.load or upcycle (each rank read only its experts)
        ranks = sorted(dist.get_process_group_ranks(expert_group(model)))
        wanted = sorted(dist.get_process_group_ranks(ep.get_group()))
        if ranks != wanted:
            rows = mesh.mesh.movedim(names.index("ep"), -1).reshape(-1, ep.size()).tolist()
            raise MoespecError(f"parallelize: this model's experts are already sharded over ranks {ranks}, but the "
                               f"mesh's ep rows are {rows}; shard them over mesh['ep'] "
                               f"(moespec.distributed.load(path, group=mesh['ep'].get_group())), or give parallelize "
                               f"the unsharded model")
    elif ep.size() > 1:
        shard_over(model, ep.get_group(), average_replicas=not fsdp)
    else:  # every rank holds every expert: the rows stay, the statistics are still global
        if getattr(model, "moespec_spec", None) is None:
            raise MoespecError("parallelize: this model was not built by moespec (no spec attached); build it with "
                               "moespec.create_model, moespec.load or moespec.distributed.load")
        for layer in moe_layers(model).values():
            layer.experts.transport = Local(dist.group.WORLD)
    if not fsdp:
        device = next(model.parameters()).device
        return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    everyone = _flat(mesh)
    scalars = [p for p in model.parameters() if p.dim() == 0]  # FSDP2 shards none: averaged as DDP would
    for layer in moe_layers(model).values():  # the experts over their replicas, each bank its own FSDP module
        fully_shard(layer.experts, mesh=dp, ignored_params=set(scalars))
        for name in BANK_ENTRIES:
            register_fsdp_forward_method(layer.experts, name)
    for block in blocks(model):
        fully_shard(block, mesh=everyone, ignored_params=set(scalars))
    fully_shard(model, mesh=everyone, ignored_params=set(scalars))
    if scalars:
        ReplicaMean(scalars, dist.group.WORLD)
    return model


def _flat(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of every rank, which the replicated weights are sharded over."""
    if mesh["ep"].size() == 1:
        return mesh["dp"]
    if mesh["dp"].size() == 1:
        return mesh["ep"]
    return mesh["dp", "ep"]._flatten("dp_ep")


def blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one (each gathered just before its forward, freed after): the outermost
    items of a module list or sequence that hold an MoE layer (a ViT's blocks, a ConvNeXt's stages)."""
    layers = set(moe_layers(model).values())
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(module, (nn.ModuleList, nn.Sequential)) and any(m in layers for m in child.modules()):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found

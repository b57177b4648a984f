"""Checkpoints that do not care about the world size.

    load(path)                  a sharded model from a moespec checkpoint: each rank reads only its experts
    upcycle(spec, checkpoint)   a sharded upcycled model: each rank builds only its experts
    save_state / load_state     model + optimizer with torch.distributed.checkpoint, resumable at any W

The model file is always the one-process format (`moespec.save` gathers a sharded model into it), so that a
checkpoint written at one world size loads at any other. Training state is saved with DCP, the experts and
their optimizer moments as DTensors sharded on the expert axis, so that DCP reshards them on load.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..compiler import create_model, materialize, moe_layers
from ..errors import MoespecError
from ..io import check_castable, checkpoint_files, safetensors_shapes
from ..layers.expert_parallel import sharded_banks
from ..planning import plan_for
from ..spec import Spec
from ..weights import check_state_dict, read_spec
from ..weights.dense import dense_model
from ..weights.mapping import dense_to_moe
from ..weights.upcycle import upcycle_layer
from .sharding import check_divisible, expert_group, require_process_group, shard_experts


def load(path: str | Path, *, group: dist.ProcessGroup | None = None, device: str | torch.device = "cpu"
         ) -> nn.Module:
    """The model of a moespec checkpoint with its experts sharded over `group` (a collective): the backbone is
    built and read whole, each MoE layer's experts are built only for this rank and read from the file as
    slices (`safe_open(...).get_slice(name)[first:last]`), never whole. In training mode."""
    require_process_group("moespec.distributed.load")
    spec = read_spec(path)
    model = create_model(spec, device=device, moe_device="meta")
    _, files = checkpoint_files(path)
    check_state_dict({name: shape for file in files for name, shape in safetensors_shapes(file).items()}, model,
                     f"{path}")
    world = dist.get_world_size(group)
    check_divisible({p: layer.experts.num_experts for p, layer in moe_layers(model).items()}, world, f"{path}")
    shard_experts(model, group)
    for layer in moe_layers(model).values():
        layer.to_empty(device=device)
    state, slices = model.state_dict(), _expert_slices(model)
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    check_castable(file, name, f.get_slice(name).get_dtype(), state[name].dtype)
                    where = slices.get(name)
                    state[name].copy_(f.get_slice(name)[where] if where is not None else f.get_tensor(name))
    return model.train()


def upcycle(spec: Spec, checkpoint: str | Path | None = None, *, seed: int = 0,
            group: dist.ProcessGroup | None = None, trust_pickle: bool = False) -> nn.Module:
    """`moespec.upcycle(spec, checkpoint, seed=seed)` with the experts sharded over `group` (a collective): the
    same weights, each rank building only its own experts. Router weights and upcycling noise come from one
    generator seeded by `seed` on every rank, which draws the noise of the other ranks' experts too (and
    discards it): a global init, never a per-rank seed."""
    require_process_group("moespec.distributed.upcycle")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # a dense model without weights gets the same fresh init as one process's
        dense, _ = dense_model(spec, checkpoint, trust_pickle=trust_pickle)
    plan = plan_for(spec, dense)  # the plan `create_model` builds: the dense model is the spec's backbone
    model = create_model(spec, moe_device="meta")
    if plan.rescales:
        raise MoespecError(f"{plan.name}: moespec.distributed.upcycle does not rebuild rescaled blocks (their fresh "
                           f"init is drawn for the whole model); upcycle with one process (`moespec upcycle`) and "
                           f"load the file with moespec.distributed.load")
    plain, ffns = dense_to_moe(plan, dense.state_dict())
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in plain:
                tensor.copy_(plain[name])
    shard_experts(model, group)
    generator = torch.Generator().manual_seed(seed)
    layers = moe_layers(model)
    for path, ffn_state in ffns.items():
        layer = materialize(layers[path])
        with torch.no_grad():
            upcycle_layer(layer, plan.layer(path), ffn_state, spec, generator)
    return model.train()


def save_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *,
               extra: dict | None = None) -> None:
    """Save model + optimizer state to the folder `path` with torch.distributed.checkpoint (a collective under
    torch.distributed; also works in one process), the experts and their optimizer moments as DTensors sharded
    on the expert axis, so that `load_state` reads it back at any world size. `extra` (step, scheduler state:
    anything JSON holds) is saved beside it. The folder is written whole under a temporary name and then
    renamed: an interrupted save leaves the previous state as it was."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    writer = not dist.is_initialized() or dist.get_rank() == 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(_training_state(model, optimizer), checkpoint_id=str(partial))
    if writer:
        (partial / EXTRA).write_text(json.dumps(extra or {}))
        if path.exists():
            old = path.with_name(path.name + ".old")
            path.rename(old)
            partial.rename(path)
            shutil.rmtree(old)
        else:
            partial.rename(path)
    if dist.is_initialized():
        dist.barrier()


def load_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load what `save_state` wrote into `model` and `optimizer` (built for it), at this world size: the model
    sharded like the one saved, over another number of ranks, or not at all. Returns the `extra` dict."""
    path = Path(path)
    if not (path / EXTRA).is_file():
        raise MoespecError(f"{path}: no training state here (save_state writes a folder with {EXTRA} in it)")
    state = _training_state(model, optimizer)
    with warnings.catch_warnings():  # in one process DCP warns that it loads without torch.distributed: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict({name: _local(t) for name, t in state["model"].items()})
    optim = state["optim"]
    optim["state"] = {name: {k: _local(v) for k, v in moments.items()} for name, moments in optim["state"].items()}
    set_optimizer_state_dict(model, optimizer, optim)
    return json.loads((path / EXTRA).read_text())


EXTRA = "extra.json"


def _training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"model", "optim"} state dicts by parameter name; under expert parallelism the sharded tensors are
    wrapped as DTensors on a 1-D mesh of the expert group."""
    slices = _expert_slices(model)
    optim = get_optimizer_state_dict(model, optimizer)
    model_state = model.state_dict()
    if not slices:
        return {"model": model_state, "optim": optim}
    mesh = DeviceMesh.from_group(expert_group(model), next(model.parameters()).device.type)
    model_state = {name: _sharded(t, mesh) if name in slices else t for name, t in model_state.items()}
    optim["state"] = {name: {k: _sharded(v, mesh) if name in slices and torch.is_tensor(v) and v.dim() else v
                             for k, v in moments.items()} for name, moments in optim["state"].items()}
    return {"model": model_state, "optim": optim}


def _sharded(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    world = mesh.size()
    shape = (local.shape[0] * world, *local.shape[1:])
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _expert_slices(model: nn.Module) -> dict[str, slice]:
    """State-dict name -> this rank's slice of the expert axis, for every sharded expert tensor."""
    found = {}
    for prefix, bank in sharded_banks(model).items():
        for name, _ in bank.named_parameters():
            found[f"{prefix}.{name}"] = slice(bank.first, bank.first + bank.local_experts)
    return found

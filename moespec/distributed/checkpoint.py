"""Checkpoints that do not care about the world size.

    load(path)                  a sharded model from a moespec checkpoint: each rank reads only its experts
    upcycle(spec, checkpoint)   a sharded upcycled model: each rank builds only its experts

The model file is always the one-process format (`moespec.save` gathers a sharded model into it), so that a
checkpoint written at one world size loads at any other. Training state (model + optimizer) is `state.py`'s.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from ..compiler import create_model, materialize, moe_layers
from ..errors import MoespecError
from ..io import check_castable, checkpoint_files, safetensors_shapes
from ..planning import plan_for
from ..spec import Spec
from ..weights import check_state_dict, read_spec
from ..weights.dense import dense_model
from ..weights.mapping import dense_to_moe
from ..weights.upcycle import upcycle_layer
from .sharding import check_divisible, expert_slices, require_process_group, shard_experts


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
    state, slices = model.state_dict(), expert_slices(model)
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

"""Checkpoints that do not care about the world size.

    load(path)                  a sharded model from a moespec checkpoint: each rank reads only its experts
    upcycle(spec, checkpoint)   a sharded upcycled model: each rank builds only its experts

The model file is always the one-process format (`moespec.save` gathers a sharded model into it), so that a
checkpoint written at one world size loads at any other. Training state (model + optimizer) is `state.py`'s.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..compiler import create_model, materialize, moe_layers
from ..errors import CheckpointError, MoespecError
from ..io import WRITE_ID_KEY, CheckpointChanged, open_checkpoint
from ..planning import plan_for
from ..spec import Spec
from ..weights import READ_ATTEMPTS, SPEC_HASH_KEY, check_state_dict, embedded_spec
from ..weights.dense import dense_model
from ..weights.mapping import dense_to_moe
from ..weights.upcycle import upcycle_layer
from .sharding import check_divisible, expert_slices, require_process_group, shard_experts

T = TypeVar("T")


def load(path: str | Path, *, group: dist.ProcessGroup | None = None, device: str | torch.device = "cpu"
         ) -> nn.Module:
    """The model of a moespec checkpoint with its experts sharded over `group` (a collective): the backbone is
    built and read whole, each MoE layer's experts are built only for this rank and read from the file as
    slices of the expert axis, never whole. In training mode.

    Every rank reads one and the same write, spec and tensors: its files are held open from the moment the
    spec is read (`io.open_checkpoint`), and the ranks compare the write ids they opened. A writer that
    replaced the checkpoint meanwhile (files that changed, or ranks that opened different writes) makes every
    rank read again, up to `READ_ATTEMPTS` times; a file that cannot be read is the same error on every rank."""
    require_process_group("moespec.distributed.load")
    for attempt in range(1, READ_ATTEMPTS + 1):
        model = _read_once(path, group, device, attempt)
        if model is not None:
            return model.train()
    raise AssertionError("unreachable: the last attempt returns or raises")


def _read_once(path: str | Path, group: dist.ProcessGroup | None, device: str | torch.device, attempt: int
               ) -> nn.Module | None:
    """One attempt of `load` on every rank: the model, or None when the ranks must read again."""
    with contextlib.ExitStack() as stack:
        checkpoint = _agreed(lambda: stack.enter_context(open_checkpoint(path)), group, attempt,
                             lambda c: [c.metadata.get(WRITE_ID_KEY), c.metadata.get(SPEC_HASH_KEY)])
        if checkpoint is None:
            return None
        model = create_model(embedded_spec(path, checkpoint.metadata), device=device, moe_device="meta")
        check_state_dict(checkpoint.shapes(), model, f"{path}")
        check_divisible({p: layer.experts.num_experts for p, layer in moe_layers(model).items()},
                        dist.get_world_size(group), f"{path}")
        shard_experts(model, group)
        for layer in moe_layers(model).values():
            layer.to_empty(device=device)
        state, rows = model.state_dict(), expert_slices(model)
        read = _agreed(lambda: checkpoint.read_into(state, rows) or True, group, attempt, lambda _: [])
        return model if read else None


def _agreed(step: Callable[[], T], group: dist.ProcessGroup | None, attempt: int, key: Callable[[T], list]
            ) -> T | None:
    """step() on every rank of `group`, and what the ranks make of it together: its result where every rank
    succeeded with the same `key` (the write it read); None where any rank saw the checkpoint change or the
    ranks read different writes (read again), or past `READ_ATTEMPTS` a `CheckpointChanged`; the lowest
    failing rank's error on every rank where any failed, so that no rank waits in a collective for one that
    raised."""
    result, outcome = None, None
    try:
        result = step()
        outcome = ["ok", key(result)]
    except CheckpointChanged as error:
        outcome = ["changed", str(error)]
    except MoespecError as error:
        outcome = ["error", str(error)]
    outcomes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, outcome, group=group)
    failed = next((o for o in outcomes if o[0] == "error"), None)
    if failed is not None:
        raise CheckpointError(failed[1])
    changed = next((o for o in outcomes if o[0] == "changed"), None)
    if changed is None and all(o == outcomes[0] for o in outcomes):
        return result
    if attempt == READ_ATTEMPTS:
        raise CheckpointChanged(changed[1] if changed is not None else
                                "the ranks read different writes of the checkpoint: a writer keeps replacing it; "
                                "load it again when the writer is done")
    return None


def upcycle(spec: Spec, checkpoint: str | Path | None = None, *, seed: int = 0,
            group: dist.ProcessGroup | None = None, trust_pickle: bool = False) -> nn.Module:
    """`moespec.upcycle(spec, checkpoint, seed=seed)` with the experts sharded over `group` (a collective): the
    same weights, each rank building only its own experts. Router weights and upcycling noise come from one
    generator seeded by `seed` on every rank, which draws the noise of the other ranks' experts too (and
    discards it): a global init, never a per-rank seed."""
    require_process_group("moespec.distributed.upcycle")
    if spec.upcycle.router_init in ("hidden", "kmeans"):
        raise MoespecError(f"{spec.source or spec.name}: upcycle.router_init: {spec.upcycle.router_init} reads images, "
                           f"which moespec.distributed.upcycle does not; upcycle with one process (`moespec upcycle "
                           f"--images DIR`) and load the file with moespec.distributed.load")
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
            upcycle_layer(layer, plan.layer(path), [ffn_state], spec, generator)
    return model.train()

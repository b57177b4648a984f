"""moespec checkpoints: a model saved with its spec inside, and rebuilt from it.

A moespec checkpoint is a safetensors file (or a sharded set, see `io.sharding`) whose header metadata holds
the spec YAML, its sha256 and the moespec version; `load` rebuilds the model from that spec and reads the
weights straight into it. Nothing is unpickled.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..backbones import create_backbone
from ..compiler import create_model
from ..errors import CheckpointError, MoespecError
from ..files import RefusedFile, hub_target
from ..io import (
    DEFAULT_MAX_SHARD_SIZE,
    CheckpointChanged,
    TensorInfo,
    check_checkpoint_output,
    checkpoint_files,
    open_checkpoint,
    refuse_existing,
    write_sharded,
)
from ..layers.steps.transport import sharded_banks
from ..spec import (
    DENSE_SUFFIXES,
    SPEC_HASH_KEY,
    Spec,
    embedded_spec,
    hub_spec,
    is_hub_folder,
    load_spec,
    spec_metadata,
)
from .dense import check_state_dict, read_state_dict, weight_cap

PICKLED_SUFFIXES = tuple(suffix for suffix in DENSE_SUFFIXES if suffix != ".safetensors")
READ_ATTEMPTS = 3  # reads of a checkpoint that a writer keeps replacing, before `load` gives up


def save(model: nn.Module, path: str | Path, *, force: bool = False, dtype: torch.dtype | None = None,
         max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Save a compiled MoE model as safetensors with its spec in the header metadata, sharded beyond
    `max_shard_size` bytes; floating tensors are cast to `dtype` if given. Returns the path to `load`.

    A model whose experts are sharded over ranks (`moespec.distributed.shard_experts`, `parallelize`) or whose
    weights FSDP2 shards is saved by a collective call on every rank: rank 0 writes the same file one process
    writes, so that it loads at any world size. Any other model is saved by the process that calls it (under
    a plain DDP: rank 0's `save(ddp, ...)`, the DDP or the model in it)."""
    model = unwrapped(model)
    spec = getattr(model, "moespec_spec", None)
    if spec is None:
        raise MoespecError("this model was not built by moespec (no spec attached); build it with moespec.create_model")
    spec, head = spec_of_head(model, spec)
    state = model.state_dict()
    if sharded_banks(model) or any(isinstance(t, DTensor) for t in state.values()):  # a collective then
        return _save_distributed(model, state, path, {**spec_metadata(spec), **head}, force=force, dtype=dtype,
                                 max_shard_size=max_shard_size)
    infos = [TensorInfo(name, tuple(t.shape), output_dtype(t.dtype, dtype)) for name, t in state.items()]
    write_sharded(path, infos, lambda info: state[info.name].to(info.dtype), {**spec_metadata(spec), **head},
                  max_shard_size=max_shard_size, force=force)
    return Path(path)


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel (FSDP2 shards a model in place: it is its own)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def _save_distributed(model: nn.Module, state: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str],
                      *, force: bool, dtype: torch.dtype | None, max_shard_size: int) -> Path:
    """`save` under torch.distributed (a collective): rank 0 writes the file one process writes, each tensor
    made whole as it reaches it, one at a time: FSDP2's shards all-gathered (`full_tensor`, on every rank),
    then a sharded bank's experts gathered from the expert-parallel group that holds rank 0 (the other groups
    hold copies). A failure on any rank fails every rank with its message, after the collectives the others
    wait in have run."""
    banks = sharded_banks(model)
    owner = {name: bank for prefix, bank in banks.items() for name in state if name.startswith(prefix + ".")}
    group = next(iter(banks.values())).transport.group if banks else None
    world = dist.get_world_size(group) if group is not None else 1
    writer = dist.get_rank() == 0
    gathers = group is not None and 0 in dist.get_process_group_ranks(group)
    problem = [None]
    if writer:  # refuse before any collective, so that no rank waits on a gather that never comes
        try:
            refuse_existing(check_checkpoint_output(path, force), force)
        except MoespecError as error:
            problem[0] = str(error)
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise MoespecError(problem[0])
    infos = [TensorInfo(name, (t.shape[0] * world, *t.shape[1:]) if name in owner else tuple(t.shape),
                        output_dtype(t.dtype, dtype)) for name, t in state.items()]
    made = [0]

    def tensor(info: TensorInfo) -> torch.Tensor:
        made[0] += 1
        local = state[info.name]
        local = (local.full_tensor() if isinstance(local, DTensor) else local).to(info.dtype).contiguous()
        if info.name not in owner or not gathers:
            return local
        pieces = [torch.empty_like(local) for _ in range(world)] if writer else None
        dist.gather(local, pieces, dst=0, group=group)
        return torch.cat(pieces) if writer else local

    error = None
    try:
        if writer:
            write_sharded(path, infos, tensor, metadata, max_shard_size=max_shard_size, force=force)
    except Exception as failed:  # the others wait in the rest of the collectives: run them, then say why
        error = failed
    for info in infos[made[0]:]:
        tensor(info)
    agree(error, f"{path}: moespec.save")
    return Path(path)


def agree(error: Exception | None, what: str) -> None:
    """Every rank learns whether any rank failed (a collective): each raises the lowest failing rank's error
    (a MoespecError with its message), rather than one raising while the others wait in the next collective."""
    found: list[str | None] = [None] * dist.get_world_size()
    mine = None if error is None else str(error) if isinstance(error, MoespecError) else \
        f"{what}: {type(error).__name__}: {error}"
    dist.all_gather_object(found, mine)
    failed = next(((rank, message) for rank, message in enumerate(found) if message is not None), None)
    if failed is None:
        return
    if isinstance(error, MoespecError) and failed[0] == dist.get_rank():
        raise error
    raise MoespecError(failed[1])


POOL_KEY = "moespec.global_pool"
"""Metadata: the pooling that timm's `reset_classifier(n, global_pool)` set after the build, when it differs."""


def spec_of_head(model: nn.Module, spec: Spec) -> tuple[Spec, dict[str, str]]:
    """`spec` with the model's head as it is now, and the metadata for its pooling. timm's `reset_classifier`
    (a fine-tune's new class count, or pooling) changes the head after the build, and a checkpoint must
    rebuild the model it holds: the class count goes into the backbone's kwargs (it sizes the head's
    weights); a changed pooling is recorded apart (`POOL_KEY`) and set again by `reset_classifier` at load,
    since as a constructor argument it also changes the layers around the head (ViT's `fc_norm`)."""
    now, built = _head(model), _head(create_backbone(spec, device="meta"))
    pool = now.get("global_pool")
    metadata = {POOL_KEY: pool} if pool is not None and pool != built.get("global_pool") else {}
    classes = now.get("num_classes")
    if classes is None or classes == built.get("num_classes"):
        return spec, metadata
    document = spec.model_dump(mode="json")
    document["backbone"]["kwargs"] = {**document["backbone"]["kwargs"], "num_classes": classes}
    return load_spec(document), metadata


def _head(model: nn.Module) -> dict[str, object]:
    """`num_classes` and `global_pool` of a timm model: its pooling kept as a name (ViT) or in a pooling module
    (`SelectAdaptivePool2d.pool_type`: ConvNeXt's head, ResNet)."""
    pool = getattr(model, "global_pool", None)
    if pool is None:
        pool = getattr(getattr(model, "head", None), "global_pool", None)
    head = {"num_classes": getattr(model, "num_classes", None),
            "global_pool": pool if isinstance(pool, str) else getattr(pool, "pool_type", None)}
    return {key: value for key, value in head.items() if isinstance(value, (int, str))}


def _pooled(model: nn.Module, metadata: dict[str, str], path: str | Path) -> nn.Module:
    """`model` with the pooling a checkpoint recorded (`POOL_KEY`) set as the saved model had it; a pooling the
    model does not take is a CheckpointError."""
    if POOL_KEY in metadata:
        pool = metadata[POOL_KEY]
        try:
            if not isinstance(pool, str) or len(pool) > 64:
                raise ValueError("not a pooling name")
            model.reset_classifier(model.num_classes, global_pool=pool)
        except Exception as error:  # timm says so with ValueError, AssertionError, KeyError...
            raise CheckpointError(f"{path}: its {POOL_KEY} {str(pool)[:64]!r} is not a pooling this model takes "
                                  f"({type(error).__name__}: {str(error)[:100]}); the file was altered") from None
    return model


def check_buffers(buffers: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Refuse a model whose loaded buffers hold a NaN, or whose balancing biases (`expert_bias`) hold an
    infinity (a value out of its dtype's range, such as 1e300 read into float32, becomes one); the biases are
    checked first. A non-finite bias sends every token to the same experts, and `update_bias` would keep it
    forever. Other buffers may be infinite: a bound (Gemma 4's clamps) is unbounded until a checkpoint sets
    it, as the dense model's buffers may be (`dense.refuse_non_finite`). `buffers`: (name, tensor) as a model's
    `named_buffers()` gives them. CheckpointError naming `source` and the tensor."""
    for name, buffer in sorted(buffers, key=lambda item: not item[0].endswith("expert_bias")):
        if not buffer.is_floating_point():
            continue
        bad = ~torch.isfinite(buffer) if name.endswith("expert_bias") else buffer.isnan()
        if bool(bad.any()):
            value = buffer[bad].flatten()[0].item()
            raise CheckpointError(f"{source}: {name} holds {value} (a balancing bias is finite, and no buffer is "
                                  f"NaN); the checkpoint was altered or saved from a diverged run; not loaded")


def output_dtype(dtype: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    """`target` for floating tensors (weights), the tensor's own dtype otherwise (integer buffers)."""
    return target if target is not None and dtype.is_floating_point else dtype


def read_spec(path: str | Path) -> Spec:
    """The spec embedded in a moespec checkpoint (checked against its hash)."""
    metadata, _ = checkpoint_files(path)
    return embedded_spec(path, metadata)


def load(path: str | Path, *, spec: Spec | str | Path | None = None, device: str | torch.device = "cpu",
         ema: bool = False, trust_pickle: bool = False) -> nn.Module:
    """The MoE model of a checkpoint, in training mode (as timm returns models).

    Without `spec`: a moespec checkpoint (one file or shards); the model is rebuilt from the spec inside it and
    its weights are read straight into it (cast to the model's dtype), so memory holds the model plus one
    tensor. With `spec` (a Spec or a spec file): any checkpoint of that spec's model: a moespec or plain
    safetensors file, or a pickled state dict or training checkpoint such as timm's `model_best.pth.tar`
    (its "state_dict", or with `ema` its "state_dict_ema"; pickled training state needs `trust_pickle`).

    A Hugging Face Hub folder of a moespec model (timm's `save_for_hf` layout: config.json beside
    model.safetensors or pytorch_model.bin) is read with the spec of its config.json (`spec.hub_spec`).
    """
    if spec is None and is_hub_folder(path):
        spec, path = hub_spec(path), hub_weights(path)
    pickled = not Path(path).is_dir() and Path(path).name.endswith(PICKLED_SUFFIXES)
    if spec is None and pickled:
        raise CheckpointError(f"{path}: a pickled checkpoint holds no spec; say which spec's model it holds "
                              f"(spec=..., or --spec on the command line)")
    if spec is not None and not isinstance(spec, Spec):
        spec = load_spec(spec)
    if pickled:
        model = create_model(spec, device=device)
        state = read_state_dict(path, trust_pickle=trust_pickle, ema=ema, max_bytes=weight_cap(model))
        check_state_dict(state, model, f"{path}")
        model.load_state_dict(state)
        check_buffers(model.named_buffers(), f"{path}")
        return model
    return _load_safetensors(path, spec, device)


HUB_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
"""The weight files of a Hub folder that timm's `save_for_hf` writes, in the order timm reads them."""


def hub_weights(folder: str | Path) -> Path:
    """The weights file of a Hub folder, as timm picks it (the first of `HUB_WEIGHTS` there), checked
    (`checked_weights`). A folder with neither name is a CheckpointError."""
    for name in HUB_WEIGHTS:
        file = Path(folder) / name
        if os.path.lexists(file):
            return checked_weights(file)
    raise CheckpointError(f"{folder}: a Hub folder without weights (no {' or '.join(HUB_WEIGHTS)})")


def checked_weights(file: Path) -> Path:
    """`file`, once it is known to be a plain file that is not empty (or a link of Hugging Face's cache to one:
    `files.hub_target`). A fifo, a folder, a device, a socket, a link of an ordinary folder or an empty file is a
    CheckpointError naming it, never opened."""
    try:
        target = hub_target(file)
    except RefusedFile as refused:
        raise CheckpointError(f"{file}: {refused}; a Hub folder's weights are a plain {file.name} file") from None
    if os.stat(target).st_size == 0:
        raise CheckpointError(f"{file}: an empty file (0 bytes), not a checkpoint; download or save it again")
    return file


def _load_safetensors(path: str | Path, spec: Spec | None, device: str | torch.device) -> nn.Module:
    """`load` of a safetensors checkpoint: the spec (embedded, unless given) and the weights from one write.
    Its files are held open from the moment the spec is read (past a few hundred shards, they are read by
    name after the model is built); read again if a writer replaced them meanwhile (`io.open_checkpoint`),
    up to `READ_ATTEMPTS` times."""
    model, spec_hash, attempts = None, None, 0
    while True:
        attempts += 1
        try:
            with open_checkpoint(path) as checkpoint:
                if model is None:
                    wanted = spec or embedded_spec(path, checkpoint.metadata)
                    # the file's shapes, checked on a build that allocates nothing, before the real build
                    check_state_dict(checkpoint.shapes(), _pooled(create_model(wanted, device="meta"),
                                                                  checkpoint.metadata, path), f"{path}")
                    model = _pooled(create_model(wanted, device=device), checkpoint.metadata, path)
                    spec_hash = checkpoint.metadata.get(SPEC_HASH_KEY)
                    if checkpoint.opened is None:  # shards read by name: read them right after their index
                        continue
                elif spec is None and checkpoint.metadata.get(SPEC_HASH_KEY) != spec_hash:
                    raise CheckpointError(f"{path}: rewritten with another spec while it was loaded; load it again")
                check_state_dict(checkpoint.shapes(), model, f"{path}")
                checkpoint.read_into(model.state_dict())
                check_buffers(model.named_buffers(), f"{path}")
                return model
        except CheckpointChanged:
            if attempts == READ_ATTEMPTS:
                raise

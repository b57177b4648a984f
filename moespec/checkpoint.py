"""Checkpoints: reading dense state dicts, and saving / loading MoE models with their spec inside.

A moespec checkpoint is a safetensors file whose header metadata holds the spec YAML, its sha256 and the
moespec version; `load` rebuilds the model from that spec and loads the weights. Nothing is unpickled:
`.pth` / `.bin` files are read with `torch.load(weights_only=True)`. Every output is written to a temp file
in the target folder, fsynced and renamed, so an interrupted write never leaves a half-written file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from .errors import CheckpointError, MoespecError

SPEC_KEY, SPEC_HASH_KEY, VERSION_KEY = "moespec.spec", "moespec.spec_sha256", "moespec.version"
DENSE_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A dense state dict from .safetensors, or .pth / .pt / .bin (plain, or under "state_dict" / "model")."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if path.suffix not in DENSE_SUFFIXES:
        raise CheckpointError(f"{path}: unknown checkpoint type {path.suffix!r}; expected one of {', '.join(DENSE_SUFFIXES)}")
    try:
        if path.suffix == ".safetensors":
            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (SafetensorError, RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot read checkpoint ({type(err).__name__}: {err}); is it truncated or not a checkpoint?") from None
    except Exception as err:  # torch.load's weights_only refusals are pickle.UnpicklingError
        raise CheckpointError(f"{path}: refused to load ({err.__class__.__name__}); moespec only loads plain tensors") from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a mapping of tensor names to tensors")
    if state and all(k.startswith("module.") for k in state):  # saved from DistributedDataParallel
        state = {k.removeprefix("module."): v for k, v in state.items()}
    return state


def check_state_dict(state: dict[str, torch.Tensor], reference: nn.Module, what: str) -> None:
    """Raise a CheckpointError naming the first missing / unexpected keys and mismatched shapes."""
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {expected[k]}"
                  for k in expected if k in state and tuple(state[k].shape) != expected[k]]
    if missing or unexpected or mismatched:
        lines = [f"{what} does not fit the backbone:"]
        for title, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", mismatched)):
            if items:
                more = f" (+{len(items) - 5} more)" if len(items) > 5 else ""
                lines.append(f"  {len(items)} {title}: {', '.join(items[:5])}{more}")
        raise CheckpointError("\n".join(lines))


@contextlib.contextmanager
def atomic_output(path: str | Path, *, force: bool = False) -> Iterator[Path]:
    """Yield a temp path in `path`'s folder; on success fsync it and rename it to `path`.

    Refuses to overwrite an existing `path` unless `force`. On any error the temp file is removed.
    """
    path = Path(path)
    if path.exists() and not force:
        raise MoespecError(f"{path} already exists; pass --force (force=True) to overwrite it")
    if not path.parent.is_dir():
        raise MoespecError(f"{path.parent}: no such folder for the output")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save(model: nn.Module, path: str | Path, *, force: bool = False) -> Path:
    """Save a compiled MoE model as safetensors, with its spec in the header metadata."""
    spec = getattr(model, "moespec_spec", None)
    if spec is None:
        raise MoespecError("this model was not built by moespec (no spec attached); build it with moespec.create_model")
    spec_yaml = spec.to_yaml()
    metadata = {SPEC_KEY: spec_yaml, SPEC_HASH_KEY: hashlib.sha256(spec_yaml.encode()).hexdigest(), VERSION_KEY: _version()}
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        if tensor.data_ptr() in seen and tensor.numel():  # safetensors refuses shared storage
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor
    with atomic_output(path, force=force) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return Path(path)


def read_spec(path: str | Path):
    """The spec embedded in a moespec checkpoint (checked against its hash)."""
    from .spec import load_spec

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err}); is it truncated?") from None
    spec_yaml = metadata.get(SPEC_KEY)
    if spec_yaml is None:
        raise CheckpointError(f"{path}: has no moespec spec in its metadata; is it a dense checkpoint? "
                              f"(upcycle it with `moespec upcycle SPEC --checkpoint {path}`)")
    if hashlib.sha256(spec_yaml.encode()).hexdigest() != metadata.get(SPEC_HASH_KEY):
        raise CheckpointError(f"{path}: the embedded spec does not match its hash; the file was altered")
    return load_spec(f"{path}[spec]", text=spec_yaml)


def load(path: str | Path, *, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild the MoE model from the spec inside a moespec checkpoint and load its weights."""
    from .compile import create_model

    spec = read_spec(path)
    model = create_model(spec, device=device)
    try:
        state = load_file(str(path), device=str(device))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path}: cannot read the weights ({err}); is it truncated?") from None
    check_state_dict(state, model, f"{path}")
    model.load_state_dict(state)
    return model


def _version() -> str:
    from . import __version__

    return __version__

"""Checkpoints: reading dense state dicts, and saving / loading MoE models with their spec inside.

A moespec checkpoint is a safetensors file whose header metadata holds the spec YAML, its sha256 and the
moespec version; `load` rebuilds the model from that spec and loads the weights. Outputs larger than one
shard use the layout transformers and timm users know:

    model-00001-of-00003.safetensors ... model-00003-of-00003.safetensors
    model.safetensors.index.json     {"metadata": {spec, hash, version, total_size}, "weight_map": {name: file}}

`write_sharded` streams tensors into the shards one at a time (the caller may build each on demand), so a
model larger than memory can be written. Nothing is unpickled: `.pth` / `.bin` files are read with
`torch.load(weights_only=True)`. Every output is written to a temp file in the target folder, fsynced and
renamed, so an interrupted write never leaves a half-written file (stale temp files of dead writers are
removed by the next write to the same path).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from .errors import CheckpointError, MoespecError

SPEC_KEY, SPEC_HASH_KEY, VERSION_KEY = "moespec.spec", "moespec.spec_sha256", "moespec.version"
DENSE_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")
DEFAULT_MAX_SHARD_SIZE = 2 * 10**9  # bytes, as transformers' "2GB"
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def read_state_dict(path: str | Path, *, trust_pickle: bool = False) -> dict[str, torch.Tensor]:
    """A dense state dict from .safetensors, or .pth / .pt / .bin (plain, or under "state_dict" / "model").

    Pickled files are read with `weights_only=True`; a file that needs arbitrary unpickling (a training
    checkpoint holding an argparse Namespace, say) is refused unless `trust_pickle`, since unpickling can run
    any code the file's author wrote."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if path.suffix not in DENSE_SUFFIXES:
        raise CheckpointError(f"{path}: unknown checkpoint type {path.suffix!r}; expected one of {', '.join(DENSE_SUFFIXES)}")
    try:
        if path.suffix == ".safetensors":
            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except (SafetensorError, RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot read checkpoint ({type(err).__name__}: {err}); is it truncated or not a checkpoint?") from None
    except Exception as err:  # torch.load's weights_only refusals are pickle.UnpicklingError
        first = str(err).strip().splitlines()[-1] if str(err).strip() else err.__class__.__name__
        raise CheckpointError(f"{path}: refused to unpickle ({first[:200]}); moespec loads plain tensors only. If you "
                              f"trust this file, pass --trust-pickle (trust_pickle=True): unpickling can run "
                              f"arbitrary code") from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a mapping of tensor names to tensors")
    if state and all(k.startswith("module.") for k in state):  # saved from DistributedDataParallel
        state = {k.removeprefix("module."): v for k, v in state.items()}
    return state


def read_safetensors_header(path: str | Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file (name -> dtype, shape, data_offsets; "__metadata__") and the byte
    offset where the data starts. Every tensor's bytes are checked to lie inside the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            if size > path.stat().st_size:
                raise ValueError("header length beyond the end of the file")
            header = json.loads(f.read(size))
        start, end = 8 + size, path.stat().st_size
        for name, entry in header.items():
            if name != "__metadata__" and start + entry["data_offsets"][1] > end:
                raise ValueError(f"{name} ends beyond the end of the file")
    except (OSError, struct.error, ValueError, KeyError, TypeError, IndexError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(err).__name__}: {err}); "
                              f"is it truncated?") from None
    return header, start


def read_safetensors_into(path: str | Path, targets: Mapping[str, torch.Tensor]) -> None:
    """Read each tensor of a safetensors file straight into `targets[name]`'s storage (cast if the dtypes
    differ), with plain reads rather than a memory map: memory holds the targets plus at most one tensor."""
    header, start = read_safetensors_header(path)
    dtypes = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    with open(path, "rb") as f, torch.no_grad():
        for name, entry in header.items():
            if name == "__metadata__" or name not in targets:
                continue
            target, (begin, end) = targets[name], entry["data_offsets"]
            same = target.dtype == dtypes[entry["dtype"]] and target.is_contiguous() and target.device.type == "cpu"
            buffer = target if same else torch.empty(entry["shape"], dtype=dtypes[entry["dtype"]])
            f.seek(start + begin)
            if f.readinto(memoryview(buffer.reshape(-1).view(torch.uint8).numpy())) != end - begin:
                raise CheckpointError(f"{path}: {name} is cut short; is the file truncated?")
            if not same:
                target.copy_(buffer)


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the header alone."""
    header, _ = read_safetensors_header(path)
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def check_state_dict(state: Mapping[str, torch.Tensor | tuple[int, ...]], reference: nn.Module, what: str) -> None:
    """Raise a CheckpointError naming the first missing / unexpected keys and mismatched shapes. `state` maps
    names to tensors, or to shapes (read from file headers without loading the data)."""
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v) for k, v in state.items()}
    missing = [k for k in expected if k not in shapes]
    unexpected = [k for k in shapes if k not in expected]
    mismatched = [f"{k}: checkpoint {shapes[k]} vs model {expected[k]}"
                  for k in expected if k in shapes and shapes[k] != expected[k]]
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

    Refuses to overwrite an existing `path` unless `force`. On any error the temp file is removed; temp files
    left by a writer that was killed are removed here, by the next write to the same path.
    """
    path = Path(path)
    if path.exists() and not force:
        raise MoespecError(f"{path} already exists; pass --force (force=True) to overwrite it")
    if not path.parent.is_dir():
        raise MoespecError(f"{path.parent}: no such folder for the output")
    remove_stale_temp_files(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, default_mode())  # mkstemp makes it private; the output should get the usual permissions
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def default_mode(directory: bool = False) -> int:
    """The permissions a new file (or folder) gets from the umask; temp files start private (0600 / 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def remove_stale_temp_files(path: Path) -> list[Path]:
    """Remove `.{name}.{pid}.*.tmp` files next to `path` whose writing process no longer runs."""
    removed = []
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@dataclass(frozen=True)
class TensorInfo:
    """Name, shape and dtype of one tensor to write: enough to lay out shards before any data exists."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()


def shard_layout(infos: Sequence[TensorInfo], max_shard_size: int) -> list[list[TensorInfo]]:
    """Split tensors, in order, into shards of at most `max_shard_size` bytes (a bigger tensor gets its own)."""
    shards: list[list[TensorInfo]] = [[]]
    size = 0
    for info in infos:
        if shards[-1] and size + info.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(info)
        size += info.nbytes
    return shards


def shard_files(path: Path, shards: int) -> list[Path]:
    """`path` itself for one shard, else `{stem}-0000i-of-0000n.safetensors` next to it."""
    if shards == 1:
        return [path]
    stem = path.name.removesuffix(".safetensors")
    return [path.with_name(f"{stem}-{i:05d}-of-{shards:05d}.safetensors") for i in range(1, shards + 1)]


def index_file(path: Path) -> Path:
    return path.with_name(path.name + ".index.json")


def write_safetensors(file: Path, infos: Sequence[TensorInfo], tensor: Callable[[TensorInfo], torch.Tensor],
                      metadata: dict[str, str]) -> None:
    """Write a safetensors file tensor by tensor: the header first (from `infos`), then each tensor's bytes as
    `tensor(info)` returns it, so only one tensor needs to exist at a time."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for info in infos:
        header[info.name] = {"dtype": SAFETENSORS_DTYPES[info.dtype], "shape": list(info.shape),
                             "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for info in infos:
            t = tensor(info)
            if tuple(t.shape) != info.shape or t.dtype != info.dtype:
                raise RuntimeError(f"{info.name}: got {tuple(t.shape)} {t.dtype}, laid out as {info.shape} {info.dtype}")
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy of the bytes


def write_sharded(path: str | Path, infos: Sequence[TensorInfo], tensor: Callable[[TensorInfo], torch.Tensor],
                  metadata: dict[str, str], *, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                  force: bool = False) -> list[Path]:
    """Write tensors to `path` (one file), or to shards next to it plus `path.index.json` when they exceed
    `max_shard_size`. All files appear together: each is written to a temp file, and the renames happen
    only once every shard is complete, the index last. A previous output at `path` (with `force`) is
    replaced whole: shards of an older layout are removed. Returns the files written, index first if any."""
    path = Path(path)
    layout = shard_layout(infos, max_shard_size)
    files = shard_files(path, len(layout))
    total = sum(info.nbytes for info in infos)
    with contextlib.ExitStack() as stack:
        index = None
        if len(files) > 1:  # entered first, renamed last: the index marks a complete output
            index = stack.enter_context(atomic_output(index_file(path), force=force))
        temps = [stack.enter_context(atomic_output(file, force=force)) for file in files]
        for temp, shard in zip(temps, layout):
            write_safetensors(temp, shard, tensor, metadata)
        if index is not None:
            weight_map = {info.name: file.name for file, shard in zip(files, layout) for info in shard}
            index.write_text(json.dumps({"metadata": {**metadata, "total_size": total}, "weight_map": weight_map},
                                        indent=2))
    _remove_old_layout(path, keep=set(files) | {index_file(path)} if len(files) > 1 else {path})
    return ([index_file(path)] if len(files) > 1 else []) + files


def _remove_old_layout(path: Path, keep: set[Path]) -> None:
    """After a forced overwrite: remove the single file or the shards and index of the previous layout."""
    old = [path, index_file(path)]
    stem = path.name.removesuffix(".safetensors")
    old += path.parent.glob(f"{stem}-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9].safetensors")
    for file in old:
        if file not in keep and file.exists():
            file.unlink()


def save(model: nn.Module, path: str | Path, *, force: bool = False, dtype: torch.dtype | None = None,
         max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Save a compiled MoE model as safetensors with its spec in the header metadata, sharded beyond
    `max_shard_size` bytes; floating tensors are cast to `dtype` if given. Returns the path to `load`."""
    spec = getattr(model, "moespec_spec", None)
    if spec is None:
        raise MoespecError("this model was not built by moespec (no spec attached); build it with moespec.create_model")
    state = model.state_dict()
    infos = [TensorInfo(name, tuple(t.shape), output_dtype(t.dtype, dtype)) for name, t in state.items()]
    write_sharded(path, infos, lambda info: state[info.name].to(info.dtype), spec_metadata(spec),
                  max_shard_size=max_shard_size, force=force)
    return Path(path)


def output_dtype(dtype: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    """`target` for floating tensors (weights), the tensor's own dtype otherwise (integer buffers)."""
    return target if target is not None and dtype.is_floating_point else dtype


def spec_metadata(spec) -> dict[str, str]:
    """The header metadata of a moespec checkpoint: the spec YAML, its sha256 and the moespec version."""
    spec_yaml = spec.to_yaml()
    return {SPEC_KEY: spec_yaml, SPEC_HASH_KEY: hashlib.sha256(spec_yaml.encode()).hexdigest(), VERSION_KEY: _version()}


def checkpoint_files(path: str | Path) -> tuple[dict[str, str], list[Path]]:
    """The metadata and weight files of a moespec checkpoint: a .safetensors file, a sharded output named by
    its base path, its index.json or its folder."""
    path = Path(path)
    if path.is_dir():
        candidates = sorted(path.glob("*.safetensors.index.json")) or sorted(path.glob("*.safetensors"))
        if len(candidates) != 1:
            found = ", ".join(c.name for c in candidates) or "no .safetensors files"
            raise CheckpointError(f"{path}: expected one checkpoint in this folder, found {found}")
        path = candidates[0]
    if path.name.endswith(".index.json") or (not path.exists() and index_file(path).is_file()):
        index = path if path.name.endswith(".index.json") else index_file(path)
        return _read_index(index)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    header, _ = read_safetensors_header(path)
    return header.get("__metadata__") or {}, [path]


def _read_index(index: Path) -> tuple[dict[str, str], list[Path]]:
    try:
        content = json.loads(index.read_text())
        metadata, weight_map = content["metadata"], content["weight_map"]
        files = sorted({index.parent / name for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{index}: not a readable safetensors index ({type(err).__name__}: {err})") from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{index}: shard(s) missing next to it: {', '.join(missing)}")
    return {k: v for k, v in metadata.items() if isinstance(v, str)}, files


def read_spec(path: str | Path):
    """The spec embedded in a moespec checkpoint (checked against its hash)."""
    from .spec import load_spec

    metadata, _ = checkpoint_files(path)
    spec_yaml = metadata.get(SPEC_KEY)
    if spec_yaml is None:
        raise CheckpointError(f"{path}: has no moespec spec in its metadata; is it a dense checkpoint? "
                              f"(upcycle it with `moespec upcycle SPEC --checkpoint {path}`)")
    if hashlib.sha256(spec_yaml.encode()).hexdigest() != metadata.get(SPEC_HASH_KEY):
        raise CheckpointError(f"{path}: the embedded spec does not match its hash; the file was altered")
    return load_spec(f"{path}[spec]", text=spec_yaml)


def load(path: str | Path, *, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild the MoE model from the spec inside a moespec checkpoint (one file or shards) and load its
    weights straight into it (cast to the model's dtype), so memory holds the model plus one tensor."""
    from .compile import create_model

    spec = read_spec(path)
    _, files = checkpoint_files(path)
    model = create_model(spec, device=device)
    shapes = {name: shape for file in files for name, shape in safetensors_shapes(file).items()}
    check_state_dict(shapes, model, f"{path}")
    targets = model.state_dict()
    for file in files:
        read_safetensors_into(file, targets)
    return model


def _version() -> str:
    from . import __version__

    return __version__

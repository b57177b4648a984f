"""Sharded outputs in the layout transformers and timm users know, written all together or not at all:

    model-00001-of-00003.safetensors ... model-00003-of-00003.safetensors
    model.safetensors.index.json     {"metadata": {...}, "weight_map": {name: file}}
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..errors import CheckpointError, MoespecError
from .atomic import atomic_output
from .safetensors import MAX_HEADER_BYTES, TensorInfo, read_safetensors_header, safetensors_shapes, write_safetensors

DEFAULT_MAX_SHARD_SIZE = 2 * 10**9  # bytes, as transformers' "2GB"
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
              "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, option: str) -> int:
    """Bytes from "2GB", "500MB", "1.5GiB" or a plain number of bytes (units as transformers reads them)."""
    number = text.strip().upper().rstrip("BIKMGT")
    unit = text.strip().upper()[len(number):]
    try:
        size = int(float(number) * SIZE_UNITS[unit])
    except (KeyError, ValueError):
        raise MoespecError(f"{option} {text!r}: expected a size such as 2GB, 500MB or 1GiB") from None
    if size <= 0:
        raise MoespecError(f"{option} {text!r}: must be positive")
    return size


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


def write_sharded(path: str | Path, infos: Sequence[TensorInfo], tensor: Callable[[TensorInfo], torch.Tensor],
                  metadata: dict[str, str], *, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                  force: bool = False) -> list[Path]:
    """Write tensors to `path` (one file), or to shards next to it plus `path.index.json` when they exceed
    `max_shard_size`. All files appear together: each is written to a temp file, and the renames happen
    only once every shard is complete, the index last. An output already at `path` (one file, or shards
    named by its index) is refused without `force`; with `force` it is replaced whole: the files of its
    layout, as its own index names them, are removed. Returns the files written, index first if any."""
    path = Path(path)
    old = refuse_existing(path, force)
    layout = shard_layout(infos, max_shard_size)
    files = shard_files(path, len(layout))
    total = sum(info.nbytes for info in infos)
    with contextlib.ExitStack() as stack:
        index = None
        if len(files) > 1:  # entered first, renamed last: the index marks a complete output
            index = stack.enter_context(atomic_output(index_file(path), force=force))
        temps = [stack.enter_context(atomic_output(file, force=force)) for file in files]
        for temp, shard in zip(temps, layout, strict=True):
            write_safetensors(temp, shard, tensor, metadata)
        if index is not None:
            weight_map = {info.name: file.name for file, shard in zip(files, layout, strict=True) for info in shard}
            index.write_text(json.dumps({"metadata": {**metadata, "total_size": total}, "weight_map": weight_map},
                                        indent=2))
    written = ([index_file(path)] if len(files) > 1 else []) + files
    for file in old:  # after a forced overwrite: the previous layout's files that the new one did not replace
        if file not in written and file.exists():
            file.unlink()
    return written


def refuse_existing(path: Path, force: bool) -> list[Path]:
    """The files of the output already at `path` (`existing_layout`); refused unless `force`."""
    old = existing_layout(path)
    if old and not force:
        shards = [f for f in old if f != path and f != index_file(path)]
        sharded = f" as a sharded checkpoint ({index_file(path).name} and {len(shards)} shard(s))" \
            if index_file(path) in old else ""
        raise MoespecError(f"{path} already exists{sharded}; pass --force to overwrite it")
    return old


def existing_layout(path: Path) -> list[Path]:
    """The files of the output already at `path`: the file itself, and the index at `path.index.json` with
    the shards it names (plain file names in its folder; any other entry is not ours to touch). Never a glob:
    other checkpoints in the folder are not part of it, whatever their names."""
    found = [path] if path.is_file() else []
    index = index_file(path)
    if index.is_file():
        found.append(index)
        try:
            names = json.loads(index.read_text())["weight_map"].values()
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            names = []
        shards = {index.parent / name for name in names if isinstance(name, str) and _plain_name(name)}
        found += sorted(shard for shard in shards if shard.is_file())
    return found


def _plain_name(name: str) -> bool:
    """A file name inside the index's own folder: no folder part, no `..`."""
    return name not in ("", ".", "..") and Path(name).name == name and "/" not in name and "\\" not in name


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
    """The metadata and shards of a sharded checkpoint's index. Every weight_map entry must be a plain file
    name next to the index (a path read from a file is never followed elsewhere), and the shards must hold
    exactly the tensors the weight_map puts in them."""
    try:
        if index.stat().st_size > MAX_HEADER_BYTES:
            raise ValueError(f"over {MAX_HEADER_BYTES} bytes")
        content = json.loads(index.read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise CheckpointError(f"{index}: not a readable safetensors index ({type(err).__name__}: {err})") from None
    if not isinstance(content, dict) or not isinstance(content.get("metadata"), dict) \
            or not isinstance(content.get("weight_map"), dict):
        raise CheckpointError(f'{index}: not a safetensors index; expected {{"metadata": {{...}}, "weight_map": '
                              f'{{tensor name: shard file name}}}}')
    weight_map = content["weight_map"]
    for name, file in weight_map.items():
        if not isinstance(file, str) or not _plain_name(file):
            raise CheckpointError(f"{index}: weight_map entry {name!r}: {file!r} is not a file name; shards are named "
                                  f"by their file name alone and sit next to the index")
    files = sorted({index.parent / name for name in weight_map.values()})
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{index}: shard(s) missing next to it: {', '.join(missing)}")
    for file in files:
        _check_shard(index, weight_map, file)
    return {k: v for k, v in content["metadata"].items() if isinstance(v, str)}, files


def _check_shard(index: Path, weight_map: dict[str, str], file: Path) -> None:
    """`file` holds exactly the tensors that `weight_map` puts in it."""
    held = safetensors_shapes(file).keys()
    stray = [name for name in held if weight_map.get(name) != file.name]
    if stray:
        where = weight_map.get(stray[0])
        said = f"puts it in {where}" if where is not None else "does not name it"
        raise CheckpointError(f"{index}: shard {file.name} holds {stray[0]!r}, but the weight_map {said}")
    absent = [name for name, shard in weight_map.items() if shard == file.name and name not in held]
    if absent:
        raise CheckpointError(f"{index}: the weight_map puts {absent[0]!r} in {file.name}, which does not hold it")

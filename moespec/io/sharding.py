"""Sharded checkpoints in the layout transformers and timm users know (written by `io.writer`), and the files a
reader takes from one:

    model-00001-of-00003.safetensors ... model-00003-of-00003.safetensors
    model.safetensors.index.json     {"metadata": {...}, "weight_map": {name: file}}
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from ..errors import CheckpointError, MoespecError
from .safetensors import MAX_HEADER_BYTES, TensorInfo, read_safetensors_header, safetensors_shapes
from .write_ids import check_write_ids, plain_name

DEFAULT_MAX_SHARD_SIZE = 2 * 10**9  # bytes, as transformers' "2GB"
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
              "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, option: str) -> int:
    """Bytes from "2GB", "500MB", "1.5GiB" or a plain number of bytes (units as transformers reads them)."""
    number = text.strip().upper().rstrip("BIKMGT")
    unit = text.strip().upper()[len(number):]
    try:
        size = float(number) * SIZE_UNITS[unit]
    except (KeyError, ValueError):
        raise MoespecError(f"{option} {text!r}: expected a size such as 2GB, 500MB or 1GiB") from None
    if not math.isfinite(size) or size < 1:  # inf, nan, 1e400; 0, negative, under a byte
        raise MoespecError(f"{option} {text!r}: expected a finite, positive size such as 2GB, 500MB or 1GiB")
    return int(size)


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
        if not isinstance(file, str) or not plain_name(file):
            raise CheckpointError(f"{index}: weight_map entry {name!r}: {file!r} is not a file name; shards are named "
                                  f"by their file name alone and sit next to the index")
    files = sorted({index.parent / name for name in weight_map.values()})
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{index}: shard(s) missing next to it: {', '.join(missing)}")
    metadata = {k: v for k, v in content["metadata"].items() if isinstance(v, str)}
    resolved = check_write_ids(index, metadata, files)  # a shard an interrupted write replaced: its kept file
    for shard, file in zip(files, resolved, strict=True):
        _check_shard(index, weight_map, shard, file)
    return metadata, resolved


def _check_shard(index: Path, weight_map: dict[str, str], shard: Path, file: Path) -> None:
    """`file` (the shard itself, or the file kept for it) holds exactly the tensors `weight_map` puts in `shard`."""
    held = safetensors_shapes(file).keys()
    stray = [name for name in held if weight_map.get(name) != shard.name]
    if stray:
        where = weight_map.get(stray[0])
        said = f"puts it in {where}" if where is not None else "does not name it"
        raise CheckpointError(f"{index}: shard {shard.name} holds {stray[0]!r}, but the weight_map {said}")
    absent = [name for name, where in weight_map.items() if where == shard.name and name not in held]
    if absent:
        raise CheckpointError(f"{index}: the weight_map puts {absent[0]!r} in {shard.name}, which does not hold it")

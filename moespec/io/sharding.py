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
from .safetensors import TensorInfo, read_safetensors_header
from .write_ids import check_write_ids

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
        metadata, files = _read_index(index)
        return metadata, check_write_ids(index, metadata, files)
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



"""Write ids: which write made each file of a sharded checkpoint, so that a reader never mixes two writes.

Every output moespec writes gets a fresh random id, `moespec.write_id` in the safetensors metadata of each
shard and in the index's metadata. Before a write replaces a shard that the current index names, it keeps
the old one under a hidden name made of the plain name and the old id, `.{shard}.{id}.prev`; the index is
renamed last. A reader (`check_write_ids`) takes each shard whose id is the index's, else the kept file with
the index's id, and refuses anything else: after a write is killed at any step, the old checkpoint or the new
one loads, never a mix. An index without a write id (transformers, timm, moespec before write ids) is read
only with shards that carry none.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

from ..errors import CheckpointError
from .safetensors import read_safetensors_header

WRITE_ID_KEY = "moespec.write_id"
_WRITE_ID = re.compile(r"[0-9a-f]{32}")


def new_write_id() -> str:
    return secrets.token_hex(16)


def valid_write_id(write_id: object) -> bool:
    return isinstance(write_id, str) and _WRITE_ID.fullmatch(write_id) is not None


def plain_name(name: str) -> bool:
    """A file name inside the index's own folder: no folder part, no `..`."""
    return name not in ("", ".", "..") and Path(name).name == name and "/" not in name and "\\" not in name


def write_id_of(file: Path) -> str | None:
    """The write id in a safetensors file's metadata (None when it has none); unreadable: CheckpointError."""
    header, _ = read_safetensors_header(file)
    metadata = header.get("__metadata__") or {}
    return metadata.get(WRITE_ID_KEY) if isinstance(metadata, dict) else None


def carries(file: Path, write_id: str | None) -> bool:
    """Whether `file` is a readable safetensors file made by the write `write_id` (None: one without an id)."""
    try:
        return file.is_file() and write_id_of(file) == write_id
    except CheckpointError:
        return False


def previous_file(shard: Path, write_id: str | None) -> Path:
    """Where a write keeps the shard it replaces, made by the write `write_id` (validated hex, or None for a
    checkpoint without write ids): a hidden name next to it, built from its plain name and that id only."""
    if not plain_name(shard.name) or not (write_id is None or valid_write_id(write_id)):
        raise ValueError(f"no kept-file name for {shard.name!r} and write id {write_id!r}")
    return shard.with_name(f".{shard.name}.{write_id}.prev" if write_id else f".{shard.name}.prev")


def check_write_ids(index: Path, metadata: dict[str, str], files: list[Path]) -> list[Path]:
    """The files to read for the shards `files` of `index`: each shard made by the index's write, or the file
    kept for it when an interrupted write replaced it. Shards of different writes are refused."""
    index_id = metadata.get(WRITE_ID_KEY)
    if index_id is not None and not valid_write_id(index_id):
        raise CheckpointError(f"{index}: {WRITE_ID_KEY} {index_id!r} is not a write id (32 hex digits)")
    resolved = []
    for shard in files:
        shard_id = write_id_of(shard)
        if shard_id == index_id:
            resolved.append(shard)
            continue
        ours = plain_name(shard.name) and shard == index.parent / shard.name
        kept = previous_file(shard, index_id) if ours else None
        if kept is not None and carries(kept, index_id):
            resolved.append(kept)
            continue
        raise CheckpointError(f"{index}: shards from different writes: {shard.name} has write id "
                              f"{shard_id or 'none'}, the index {index_id or 'none'}; the write that made them was "
                              f"interrupted or files were copied in by hand")
    return resolved

"""Sharded checkpoints in the layout transformers and timm users know (written by `io.writer`), and the files a
reader takes from one:

    model-00001-of-00003.safetensors ... model-00003-of-00003.safetensors
    model.safetensors.index.json     {"metadata": {...}, "weight_map": {name: file}}

A reader that runs while a writer replaces the checkpoint reads one write or fails cleanly (`open_checkpoint`):
a one-file checkpoint is read, spec and tensors, through one open file; each shard is read through a handle
whose write id is checked to be the index's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch

from ..errors import CheckpointError
from .outputs import INDEX_SUFFIX, parse_size  # noqa: F401 (parse_size: this module's name for it too)
from .safetensors import (
    CheckpointChanged,
    SafetensorsFile,
    TensorInfo,
    open_safetensors,
    read_safetensors_into,
    safetensors_shapes,
)
from .write_ids import WRITE_ID_KEY, check_write_ids, plain_name

DEFAULT_MAX_SHARD_SIZE = 2 * 10**9  # bytes, as transformers' "2GB"
MAX_INDEX_BYTES = 50_000_000
"""The largest index (or write journal) read: a weight_map of half a million tensors is under 50 MB."""
SHARD_NAME = re.compile(r"(.+)-\d{5,}-of-\d{5,}\.safetensors")
NAMED = 3  # files a message names before it counts the rest


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
    path = checkpoint_path(path)
    if path.name.endswith(".index.json") or (not path.exists() and index_file(path).is_file()):
        index = path if path.name.endswith(".index.json") else index_file(path)
        return _read_index(index)
    with open_safetensors(_regular_file(path)) as file:
        return file.metadata, [path]


def checkpoint_path(path: str | Path) -> Path:
    """The path a checkpoint is read by: `path`, or for a folder the one checkpoint in it, by the same base
    path a user would type (`_checkpoint_in`)."""
    path = Path(path)
    return _checkpoint_in(path) if path.is_dir() else path


def _checkpoint_in(folder: Path) -> Path:
    """The base path of the one checkpoint in `folder`: an index's (its one file, if there is one too, is what
    the base path reads), else the one .safetensors file that is not a shard of another file's name (shards
    that an interrupted write to that file left). Hidden files (temp and kept files) are not checkpoints."""
    entries = {p.name: p for p in folder.iterdir() if not p.name.startswith(".")}
    candidates = sorted(name.removesuffix(".index.json") for name in entries
                        if name.endswith(INDEX_SUFFIX) and name != INDEX_SUFFIX)
    if not candidates:
        for name, entry in sorted(entries.items()):
            shard = SHARD_NAME.fullmatch(name)
            if name.endswith(".safetensors") and not entry.is_dir() \
                    and not (shard and f"{shard[1]}.safetensors" in entries):
                candidates.append(name)
    if len(candidates) != 1:
        found = _some(candidates) or "no .safetensors files"
        raise CheckpointError(f"{folder}: expected one checkpoint in this folder, found {found}")
    return folder / candidates[0]


def _some(names: Sequence[str]) -> str:
    """The first few of `names` and how many more: a message stays short however many there are."""
    more = f" and {len(names) - NAMED} more" if len(names) > NAMED else ""
    return ", ".join(names[:NAMED]) + more


def _regular_file(path: Path) -> Path:
    """`path` if it is a regular file (a link to one is), else a CheckpointError that says what it is."""
    what = not_a_file(path)
    if what is not None:
        raise CheckpointError(f"{path}: no such checkpoint file" if what == "missing" else
                              f"{path}: not a checkpoint file ({what})")
    return path


def not_a_file(path: Path) -> str | None:
    """None for a regular file (or a link to one), else what `path` is: "missing", "a folder", "a fifo"..."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as err:
        return err.strerror or type(err).__name__
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISDIR: "a folder", stat.S_ISFIFO: "a fifo", stat.S_ISCHR: "a device", stat.S_ISBLK: "a device",
             stat.S_ISSOCK: "a socket"}
    return next((kind for test, kind in kinds.items() if test(mode)), "not a regular file")


def read_json(file: Path, what: str) -> object:
    """The JSON in `file`, read only if it is a regular file of at most `MAX_INDEX_BYTES`; anything else is a
    CheckpointError that says so, unread. Unreadable or not JSON: OSError / ValueError, for the caller."""
    fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a fifo opens without waiting for a writer
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{file}: not {what}: {not_a_file(file)}, not a file")
        raw = f.read(MAX_INDEX_BYTES + 1)
    if len(raw) > MAX_INDEX_BYTES:
        raise CheckpointError(f"{file}: {info.st_size:,} bytes, more than {what} can be (at most "
                              f"{MAX_INDEX_BYTES:,}); not read")
    return json.loads(raw)


def _read_index(index: Path) -> tuple[dict[str, str], list[Path]]:
    """The metadata and shards of a sharded checkpoint's index. Every weight_map entry must be a plain file
    name next to the index (a path read from a file is never followed elsewhere), and the shards must hold
    exactly the tensors the weight_map puts in them. Linear in the number of tensors and shards."""
    try:
        content = read_json(_regular_file(index), "a safetensors index")
    except (OSError, ValueError, RecursionError) as err:
        raise CheckpointError(f"{index}: not a readable safetensors index ({type(err).__name__}: "
                              f"{str(err)[:200]})") from None
    if not isinstance(content, dict) or not isinstance(content.get("metadata"), dict) \
            or not isinstance(content.get("weight_map"), dict):
        raise CheckpointError(f'{index}: not a safetensors index; expected {{"metadata": {{...}}, "weight_map": '
                              f'{{tensor name: shard file name}}}}')
    weight_map = content["weight_map"]
    held: dict[str, list[str]] = {}  # shard name -> the tensors the weight_map puts in it
    for name, file in weight_map.items():
        if not isinstance(file, str) or not plain_name(file):
            raise CheckpointError(f"{index}: weight_map entry {name[:100]!r}: {str(file)[:100]!r} is not a file "
                                  f"name; shards are named by their file name alone and sit next to the index")
        held.setdefault(file, []).append(name)
    if not held:
        raise CheckpointError(f"{index}: a safetensors index that names no shard (its weight_map is empty)")
    files = sorted(index.parent / name for name in held)
    unreadable = {f.name: what for f in files if (what := not_a_file(f)) is not None}
    if unreadable:
        named = [name if what == "missing" else f"{name} ({what}, not a file)" for name, what in unreadable.items()]
        missing = "missing" if set(unreadable.values()) == {"missing"} else "missing or not files"
        raise CheckpointError(f"{index}: shard(s) {missing} next to it: {_some(named)} ({len(unreadable)} of "
                              f"{len(files)})")
    metadata = {k: v for k, v in content["metadata"].items() if isinstance(v, str)}
    resolved = check_write_ids(index, metadata, files)  # a shard an interrupted write replaced: its kept file
    for shard, file in zip(files, resolved, strict=True):
        _check_shard(index, weight_map, held[shard.name], shard, file)
    return metadata, resolved


def _check_shard(index: Path, weight_map: dict[str, str], names: list[str], shard: Path, file: Path) -> None:
    """`file` (the shard itself, or the file kept for it) holds exactly the tensors `names` that `weight_map`
    puts in `shard`."""
    held = safetensors_shapes(file).keys()
    stray = [name for name in held if weight_map.get(name) != shard.name]
    if stray:
        where = weight_map.get(stray[0])
        said = f"puts it in {where}" if where is not None else "does not name it"
        raise CheckpointError(f"{index}: shard {shard.name} holds {stray[0]!r}, but the weight_map {said}")
    absent = [name for name in names if name not in held]
    if absent:
        raise CheckpointError(f"{index}: the weight_map puts {absent[0]!r} in {shard.name}, which does not hold it")


@dataclass
class Checkpoint:
    """A checkpoint opened for reading (`open_checkpoint`): its metadata, and tensors that come from the same
    write. Its files are held open (`opened`) from the moment its metadata was read, so that nothing a writer
    does meanwhile changes what is read; past `MAX_HELD_FILES` shards, each shard's write id is checked as it
    is read instead."""

    path: Path
    metadata: dict[str, str]
    files: list[Path]
    opened: list[SafetensorsFile] | None  # one per file, or None: read by name, write ids checked

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape, from the headers."""
        if self.opened is None:
            return {name: shape for file in self.files for name, shape in safetensors_shapes(file).items()}
        return {name: tuple(entry["shape"]) for file in self.opened for name, entry in file.header.items()
                if name != "__metadata__"}

    def read_into(self, targets: Mapping[str, torch.Tensor], rows: Mapping[str, slice] | None = None) -> None:
        """Read every tensor into `targets[name]` (`read_safetensors_into`; those in `rows` only for those rows
        of their first axis). A shard read by name that is no longer the index's write (a writer replaced it
        since the index was read) is a `CheckpointChanged`."""
        if self.opened is not None:
            for file in self.opened:
                read_safetensors_into(file, targets, rows)
            return
        for file in self.files:
            with _open_shard(self.path, file, self.metadata.get(WRITE_ID_KEY)) as shard:
                read_safetensors_into(shard, targets, rows)


MAX_HELD_FILES = 256  # shards held open at once by a reader, well under the usual limit of 1024 open files


def _open_shard(path: Path, file: Path, write_id: str | None) -> SafetensorsFile:
    """`file` of the sharded checkpoint `path`, open, if it is still of the write `write_id`, else a
    `CheckpointChanged`."""
    try:
        shard = open_safetensors(file)
    except CheckpointError as err:
        raise CheckpointChanged(f"{path}: {file.name} changed while it was read ({err})") from None
    if shard.metadata.get(WRITE_ID_KEY) != write_id:
        shard.handle.close()
        raise CheckpointChanged(f"{path}: {file.name} was replaced by another write while it was read")
    return shard


@contextlib.contextmanager
def open_checkpoint(path: str | Path) -> Iterator[Checkpoint]:
    """`checkpoint_files`, opened so that everything read comes from one write: the metadata (the spec) and the
    tensors. A writer that replaced the files while they were opened is a `CheckpointChanged`: read again."""
    base = checkpoint_path(path)
    if not (base.name.endswith(".index.json") or (not base.exists() and index_file(base).is_file())):
        with open_safetensors(_regular_file(base)) as file:
            yield Checkpoint(Path(path), file.metadata, [base], [file])
        return
    index = base if base.name.endswith(".index.json") else index_file(base)
    before = _identity(index)
    with contextlib.ExitStack() as stack:
        try:
            metadata, files = _read_index(index)
            opened = None if len(files) > MAX_HELD_FILES else [
                stack.enter_context(_open_shard(Path(path), file, metadata.get(WRITE_ID_KEY))) for file in files]
        except CheckpointError as err:
            if isinstance(err, CheckpointChanged) or _identity(index) == before:
                raise
            raise CheckpointChanged(f"{index}: replaced by another write while it was read") from None
        yield Checkpoint(Path(path), metadata, files, opened)


def _identity(file: Path) -> tuple[int, int] | None:
    """Which file `file` is now (a writer replaces files, never rewrites them); None if there is none."""
    try:
        info = os.stat(file)
    except OSError:
        return None
    return info.st_dev, info.st_ino

"""`write_sharded`: a (sharded) safetensors output that a reader sees whole, old or new, even if the writer dies.

The steps, each safe to be killed after:

    1. journal   `.{name}.write.json` next to the output: this write's id and files, the ids and files of the
                 output it replaces and of any earlier write that was interrupted (so the next write can clean up)
    2. temps     every file written under a temp name (`atomic.temp_output`)
    3. shards    each renamed into place; one that the current index names is first kept (`write_ids`)
    4. index     renamed into place: the commit
    5. cleanup   the previous output's files, the kept files and the journal removed

Before step 4 a reader of the index reads the old checkpoint (the kept files where shards were replaced),
after it the new one. A one-file output is its own commit. Files are only ever removed by name: the old
index's shards, and files named in the journal that carry one of its write ids; never a glob.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..errors import MoespecError
from .atomic import check_output, commit, remove_stale_temp_files, temp_output
from .lock import output_lock
from .outputs import check_checkpoint_output  # noqa: F401 (this module's name for it too)
from .safetensors import TensorInfo, write_safetensors
from .sharding import DEFAULT_MAX_SHARD_SIZE, index_file, read_json, shard_files, shard_layout
from .write_ids import (
    WRITE_ID_KEY,
    carries,
    new_write_id,
    plain_name,
    previous_file,
    valid_write_id,
)


def write_sharded(path: str | Path, infos: Sequence[TensorInfo], tensor: Callable[[TensorInfo], torch.Tensor],
                  metadata: dict[str, str], *, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                  force: bool = False) -> list[Path]:
    """Write tensors to `path` (one file), or to shards next to it plus `path.index.json` when they exceed
    `max_shard_size`, all or nothing as a reader sees it (module docstring). An output already at `path` (one
    file, or shards named by its index), or one an interrupted write left, is refused without `force`; with
    `force` it is replaced whole. One writer at a time: the output's lock (`lock.output_lock`) is held for
    the whole write, and a second writer waits for it or is refused. A full disk or an unwritable folder is
    a `MoespecError`; the previous output is then what a reader sees. Returns the files written, index first
    if any."""
    path = check_checkpoint_output(path, force)
    with output_lock(path):
        return _write_sharded(path, infos, tensor, metadata, max_shard_size, force)


def _write_sharded(path: Path, infos: Sequence[TensorInfo], tensor: Callable[[TensorInfo], torch.Tensor],
                   metadata: dict[str, str], max_shard_size: int, force: bool) -> list[Path]:
    """`write_sharded` under the output's lock."""
    old = refuse_existing(path, force)
    layout = shard_layout(infos, max_shard_size)
    files = shard_files(path, len(layout))
    index = index_file(path) if len(files) > 1 else None
    written = ([index] if index is not None else []) + files
    earlier = _Journal.read(path)
    interrupted = [i for i in earlier.write_ids if i is not None]
    for file in written:  # a shard an interrupted write renamed into place is that write's, not a user's
        if not (file.is_file() and any(carries(file, i) for i in interrupted)):
            check_output(file, force)
    write_id = new_write_id()
    kept_for = _index_write_id(path)  # the write a reader of the current index reads, and its shard names
    journal = earlier.extend(write_id, [kept_for[0]] if kept_for else [], old + written)
    for name in journal.names:
        remove_stale_temp_files(path.with_name(name))
    metadata = {**metadata, WRITE_ID_KEY: write_id}
    renamed = False
    try:
        journal.write(path)
        with contextlib.ExitStack() as stack:
            temps = [stack.enter_context(temp_output(file)) for file in written]
            for temp, shard in zip(temps[-len(files):], layout, strict=True):
                write_safetensors(temp, shard, tensor, metadata)
            if index is not None:
                weight_map = {info.name: file.name for file, shard in zip(files, layout, strict=True)
                              for info in shard}
                total = sum(info.nbytes for info in infos)
                temps[0].write_text(json.dumps({"metadata": {**metadata, "total_size": total},
                                                "weight_map": weight_map}, indent=2))
            for temp, file in zip(temps[-len(files):], files, strict=True):
                renamed = True
                if kept_for and file.name in kept_for[1]:
                    _keep(file, kept_for[0])
                commit(temp, file)
            if index is not None:
                commit(temps[0], index)
    except BaseException as err:
        if not renamed and earlier.empty:  # nothing changed: nothing for the next write to clean up
            _Journal.file(path).unlink(missing_ok=True)
        if isinstance(err, OSError):  # a full disk, a folder made read-only meanwhile
            raise MoespecError(f"{path}: cannot write it ({err.strerror or err}); the output there before, if "
                               f"any, is what a reader still gets") from None
        raise
    try:
        _clean_up(path, old, written, journal, kept_for[0] if kept_for else None)
    except OSError as err:
        raise MoespecError(f"{path}: written, but the previous output's files could not all be removed "
                           f"({err.strerror or err}); the next write with --force removes them") from None
    return written


def refuse_existing(path: Path, force: bool) -> list[Path]:
    """The files of the output already at `path` (`existing_layout`); refused unless `force`. What an
    interrupted write to an output that is not there left is not refused: the next write removes it (its own
    files, by their write ids in the journal)."""
    old = existing_layout(path)
    index = index_file(path)
    if old and not force:
        if index in old and _index_content(index) is None:
            raise MoespecError(f"{index} already exists and is not a safetensors index; pass --force to overwrite it")
        shards = [f for f in old if f != path and f != index]
        sharded = f" as a sharded checkpoint ({index.name} and {len(shards)} shard(s))" if index in old else ""
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
        content = _index_content(index)
        shards = {index.parent / name for name in content[1]} if content is not None else set()
        found += sorted(shard for shard in shards if shard.is_file())
    return found


def _index_content(index: Path) -> tuple[object, list[str]] | None:
    """The write id and the plain shard names of an index; None for one that is not a readable index (or names
    no shard). One larger than an index can be is refused unread."""
    try:
        content = read_json(index, "a safetensors index")
        write_id, names = content["metadata"].get(WRITE_ID_KEY), list(content["weight_map"].values())
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError):
        return None
    return (write_id, sorted({name for name in names if isinstance(name, str) and plain_name(name)})) if names else None


def _index_write_id(path: Path) -> tuple[str | None, set[str]] | None:
    """The write id of the index at `path.index.json` (None: an index without one) and its shard names; None
    when there is no index, or its id is malformed (nothing it names is then worth keeping)."""
    index = index_file(path)
    content = _index_content(index) if index.is_file() else None
    if content is None:
        return None
    write_id, names = content
    if write_id is not None and not valid_write_id(write_id):
        return None
    return write_id, set(names)


def _keep(shard: Path, write_id: str | None) -> None:
    """Before `shard` is replaced: keep what a reader of the current index (made by `write_id`) reads under its
    name at `previous_file(shard, write_id)`, a hard link (a copy where the file system has none)."""
    kept = previous_file(shard, write_id)
    if carries(kept, write_id) or not carries(shard, write_id):
        return  # already kept by an interrupted write, or not the index's shard (nothing to keep)
    kept.unlink(missing_ok=True)
    try:
        os.link(shard, kept)
    except OSError:
        with temp_output(kept) as tmp:
            shutil.copyfile(shard, tmp)
            commit(tmp, kept)


def output_names(path: Path, name: str) -> bool:
    """Whether `name` is one that a write to `path` gives its files: `path`'s own, its index's, or a shard's
    (`{stem}-0000i-of-0000n.safetensors`). Nothing else next to it is ever a write's to remove."""
    stem = re.escape(path.name.removesuffix(".safetensors"))
    return name in (path.name, index_file(path).name) or re.fullmatch(rf"{stem}-\d{{5,}}-of-\d{{5,}}\.safetensors",
                                                                      name) is not None


def _clean_up(path: Path, old: list[Path], written: list[Path], journal: _Journal, old_id: str | None) -> None:
    """After the commit: remove the files this write can prove are the output's. The previous output's files:
    `path` and its index, and each shard the index names with a shard's name and the index's write id. The
    files that interrupted writes left: shards' names carrying one of the journal's write ids (a journal is
    not trusted: it only says which names and ids to check), and the kept files of those names. Then the
    journal."""
    index = index_file(path)
    for file in sorted(old, key=lambda f: f != index):
        if file not in written and (file in (path, index) or output_names(path, file.name) and carries(file, old_id)):
            file.unlink(missing_ok=True)
    new_ids = [i for i in journal.write_ids if i is not None]
    for name in journal.names:
        if not output_names(path, name):
            continue
        file = path.with_name(name)
        if file not in written and file.is_file() and any(carries(file, i) for i in new_ids):
            file.unlink()
        for write_id in journal.write_ids:
            kept = previous_file(file, write_id)
            if carries(kept, write_id):
                kept.unlink()
    _Journal.file(path).unlink(missing_ok=True)


@dataclass(frozen=True)
class _Journal:
    """What the files next to an output may hold from writes to it that are not finished: their write ids
    (None: a checkpoint without write ids) and the plain names of their files."""

    write_ids: frozenset[str | None] = frozenset()
    names: frozenset[str] = frozenset()

    @property
    def empty(self) -> bool:
        return not self.write_ids and not self.names

    @staticmethod
    def file(path: Path) -> Path:
        return path.with_name(f".{path.name}.write.json")

    @classmethod
    def read(cls, path: Path) -> _Journal:
        """The journal an interrupted write left; only valid ids and the names of this output's files are taken
        from it. One larger than a journal can be is refused unread."""
        if not cls.file(path).is_file():
            return cls()
        try:
            content = read_json(cls.file(path), "a moespec write journal")
            ids, names = list(content["write_ids"]), list(content["names"])
        except (OSError, ValueError, RecursionError, KeyError, TypeError):
            return cls()
        return cls(frozenset(i for i in ids if i is None or valid_write_id(i)),
                   frozenset(n for n in names if isinstance(n, str) and plain_name(n) and output_names(path, n)))

    def extend(self, write_id: str, replaced_ids: list[str | None], files: list[Path]) -> _Journal:
        return _Journal(self.write_ids | {write_id, *replaced_ids}, self.names | {f.name for f in files})

    def write(self, path: Path) -> None:
        """Under the output's lock: a plain temp file and rename, no lock of its own."""
        with temp_output(self.file(path)) as tmp:
            tmp.write_text(json.dumps({"write_ids": sorted(self.write_ids, key=str), "names": sorted(self.names)}))
            commit(tmp, self.file(path))

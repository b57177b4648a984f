"""Reading a training-state folder (`state.load_state`), trusting none of it: bounded JSON files, DCP's
`.metadata` unpickled by an unpickler that builds DCP's own metadata classes and nothing else (never read when
it is larger than the data it describes), and the non-tensor items through `torch.load(weights_only=True)`,
where DCP's default planner would unpickle anything."""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, Metadata
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ..errors import CheckpointError
from ..files import RefusedFile, load_json, read_regular
from ..weights import SPEC_HASH_KEY, spec_metadata

EXTRA, SPEC_FILE, METADATA, MARK = "extra.json", "spec.json", ".metadata", "moespec_state.json"
MARK_CONTENTS = '{"format": "moespec training state"}'
DISTCP_FILE = re.compile(r"__\d+_\d+\.distcp\Z")
STATE_FILE = re.compile(r"(\.metadata(\.tmp)?|__\d+_\d+\.distcp|extra\.json|spec\.json|moespec_state\.json)\Z")
"""Every file a save writes into the folder (`.metadata.tmp` while DCP finishes): nothing else is ours."""
SPEC_NAME_KEY = "moespec.spec_name"
METADATA_SLACK_BYTES = 16 * 2**20
"""DCP's `.metadata` is smaller than the data it describes (each entry is a few hundred bytes, each tensor or
value it points to a torch.save blob of more); one larger than the data plus this is refused unread."""
MAX_JSON_BYTES = 64 * 2**20  # extra.json and spec.json: a step count, a scheduler, a spec
MAX_METADATA_BYTES = 2**31  # DCP's .metadata, beyond the check against the data it describes


def _read_state_files(path: Path) -> tuple[Any, Any, Metadata]:
    """(extra, the spec.json dict or None for a state saved before it, DCP's metadata) of the folder `path`,
    read before DCP runs: DCP reports a metadata it cannot read as an AssertionError after logging a traceback
    and trying another file."""
    if not os.path.lexists(path / EXTRA):
        raise CheckpointError(f"{path}: no training state here (save_state writes a folder with {EXTRA} in it)")
    if not os.path.lexists(path / METADATA):
        raise CheckpointError(f"{path}: has {EXTRA} but no {METADATA}; is the folder complete, as save_state wrote it?")
    saved = _read_json(path / SPEC_FILE) if os.path.lexists(path / SPEC_FILE) else None
    return _read_json(path / EXTRA), saved, _read_metadata(path, path / METADATA)


def _on_every_rank(read):
    """read() on every rank. Under torch.distributed the ranks agree: when it fails on any rank, every rank
    raises the lowest failing rank's CheckpointError, rather than one raising while the others wait for it in
    the next collective."""
    result, error = None, None
    try:
        result = read()
    except CheckpointError as failed:
        error = str(failed)
    if dist.is_initialized():
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise CheckpointError(error)
    return result


def _read_json(file: Path) -> Any:
    """A state's JSON file: a plain file of at most MAX_JSON_BYTES, nested at most MAX_JSON_DEPTH deep."""
    try:
        return load_json(read_regular(file, MAX_JSON_BYTES))
    except RefusedFile as error:
        raise CheckpointError(f"{file}: {error} (a training state's {file.name} is a plain JSON file)") from None
    except ValueError as error:
        raise CheckpointError(f"{file}: not the JSON save_state writes ({str(error)[:120]})") from None


def _read_metadata(folder: Path, file: Path) -> Metadata:
    """DCP's `.metadata` of `folder`, unpickled by `_MetadataUnpickler`; refused unread when larger than the
    folder's data (plus METADATA_SLACK_BYTES), and checked to point only at the folder's own `.distcp` files."""
    size = file.lstat().st_size
    data_size = sum(f.stat().st_size for f in folder.glob("*.distcp") if f.is_file())
    if size > data_size + METADATA_SLACK_BYTES:
        raise CheckpointError(f"{file}: {size} bytes of DCP metadata for {data_size} bytes of data; a training "
                              f"state's metadata is smaller than its data; not read")
    try:
        pickled = read_regular(file, min(data_size + METADATA_SLACK_BYTES, MAX_METADATA_BYTES))
    except RefusedFile as error:
        raise CheckpointError(f"{file}: {error} (a training state's {METADATA} is a plain file)") from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(pickled)).load()
    except Exception as error:  # a refused class, a truncated or junk pickle: all one refusal
        raise CheckpointError(f"{file}: not DCP metadata as save_state writes it ({_gist(error)}); "
                              f"nothing in it was run") from None
    if not (isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)
            and isinstance(metadata.storage_data, dict)
            and all(isinstance(i, _StorageInfo) and isinstance(i.relative_path, str)
                    and DISTCP_FILE.match(i.relative_path) and isinstance(i.offset, int) and isinstance(i.length, int)
                    and i.offset >= 0 and i.length >= 0 for i in metadata.storage_data.values())):
        raise CheckpointError(f"{file}: not DCP metadata as save_state writes it (it must point at "
                              f"__RANK_N.distcp files of its own folder)")
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        data_file = folder / name
        if not data_file.is_file():
            raise CheckpointError(f"{data_file}: missing; the training state's {METADATA} points at it")
        if data_file.stat().st_size < end:
            raise CheckpointError(f"{data_file}: cut short at {data_file.stat().st_size} bytes; the training "
                                  f"state's {METADATA} places data up to byte {end}")
    return metadata


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds DCP's metadata classes, torch dtypes, sizes and layouts, and paths, and refuses
    every other global: a planted `.metadata` whose pickle would run code is refused before anything runs."""

    ALLOWED = {(c.__module__, c.__qualname__): c for c in (
        Metadata, dcp_metadata.MetadataIndex, dcp_metadata.StorageMeta, dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata, dcp_metadata.ChunkStorageMetadata, dcp_metadata.TensorProperties,
        dcp_metadata._MEM_FORMAT_ENCODING, _StorageInfo, torch.Size, torch.serialization._get_layout)}
    PATHS = ("PurePosixPath", "PureWindowsPath", "PosixPath", "WindowsPath", "Path")  # StorageMeta.checkpoint_id

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return self.ALLOWED[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.split(".")[0] == "pathlib" and name in self.PATHS:
            return getattr(pathlib, name)
        raise pickle.UnpicklingError(f"refused to build {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id")


class _SafeReader(FileSystemReader):
    """DCP's file reader, given the metadata that `_read_metadata` read (bounded, by a restricted unpickler)
    instead of unpickling `.metadata` itself."""

    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(path)
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self.metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that checks every tensor against the saved ones first (a clear error naming
    the spec the state was saved with and the first mismatch, where DCP says "Size mismatch"), and reads the
    non-tensor items with `torch.load(weights_only=True)` (DCP's own loads them with weights_only=False)."""

    def __init__(self, path: Path, spec_note: str):
        super().__init__()
        self.path, self.spec_note = path, spec_note

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False
                       ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        mismatch = _first_mismatch(self.state_dict, metadata.state_dict_metadata)
        if mismatch:
            hint = "; resume with the spec it was saved with" if self.spec_note else ""
            raise CheckpointError(f"{self.path}: {self.spec_note or 'saved for another model or optimizer'}: "
                                  f"{mismatch}{hint}")

    def load_bytes(self, read_item: Any, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as error:
            raise CheckpointError(f"{self.path}: refused to unpickle the saved {fqn} ({_gist(error)}); a training "
                                  f"state holds plain values there") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _first_mismatch(state: dict[str, Any], saved: dict[str, Any]) -> str:
    """The first entry of the (flattened) state dict that the saved state lacks or holds at another shape, and
    how many more are missing; "" when every entry fits."""
    missing = [fqn for fqn in state if fqn not in saved]
    for fqn, value in state.items():
        kept = saved.get(fqn)
        if torch.is_tensor(value) and kept is not None:
            if not isinstance(kept, dcp_metadata.TensorStorageMetadata):
                return f"{fqn} is a tensor here, a value there"
            if tuple(kept.size) != tuple(value.size()):
                return f"{fqn} is {list(kept.size)} there, {list(value.size())} here"
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return f"it has no {missing[0]}{more}"
    return ""


def _spec_mismatch(saved: Any, spec: Any) -> str:
    """"saved with spec 'a' (sha256 ...), this model is spec 'b' (...)" when `spec.json` names another spec
    than the model's; "" when the spec is the same or either is unknown (a state saved before spec.json)."""
    if not isinstance(saved, dict) or spec is None:
        return ""
    ours = spec_metadata(spec)
    if saved.get(SPEC_HASH_KEY) == ours[SPEC_HASH_KEY]:
        return ""
    return (f"saved with spec {_described(saved.get(SPEC_NAME_KEY), saved.get(SPEC_HASH_KEY))}, this model is spec "
            f"{_described(spec.name, ours[SPEC_HASH_KEY])}")


def _described(name: Any, digest: Any) -> str:
    return f"{name if isinstance(name, str) else 'unnamed'!r} (sha256 {str(digest)[:12]})"


def _gist(error: BaseException) -> str:
    """An exception's message in one short line: the reason torch.load's weights-only unpickler gives, or the
    first sentence of the first line."""
    text = str(error)
    reason = re.search(r"WeightsUnpickler error:\s*(\S.*)", text)
    line = reason[1] if reason else next((line.strip() for line in text.splitlines() if line.strip()), "")
    return line.split(". ")[0][:160] or type(error).__name__

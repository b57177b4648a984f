"""Training state: model + optimizer with torch.distributed.checkpoint (DCP), resumable at any world size.

    save_state(path, model, optimizer, extra=...)   a collective; the folder is replaced whole or not at all
    load_state(path, model, optimizer) -> extra     the experts resharded to this world size

A state folder holds DCP's `.metadata` and `__{rank}_{n}.distcp` files, `extra.json` (the caller's dict),
`spec.json` (the spec the model was compiled from, so that a state that does not fit says which spec it was
saved with) and `moespec_state.json`, the mark that says a save_state wrote it. A save replaces a folder only
when it is such a state (or one of before the mark, holding nothing but state files), an empty folder, or with
`force=True`; a symbolic link at the path is followed only to a state folder, which is then replaced in place
of the link. Written under a temporary name `.{name}.{pid}@{host}.{random}.tmp`, it is swapped in by two renames
with the old folder moved aside under a name no folder has, `.{name}.old-{pid}@{host}[.{random}]`. A save killed
between the two leaves no folder at `path`; the next save_state or load_state finishes the swap (`_recover`),
and removes what a killed save left, but only folders named by a process of this host that no longer runs and
holding nothing but state files. Another host's (a folder shared over NFS) are never touched, whatever their
pid (`io.atomic.owner_tag`); one that holds the only copy of the state is named in the error.

Reading trusts the folder no more than a safetensors file: `.metadata` is a pickle, read by an unpickler that
builds DCP's own metadata classes and nothing else, and never read when it is larger than the data it
describes; the few non-tensor items (optimizer hyperparameters) are read with `torch.load(weights_only=True)`,
where DCP's default planner would unpickle anything.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pathlib
import pickle
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, Metadata
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..errors import CheckpointError, MoespecError
from ..files import RefusedFile, load_json, read_regular
from ..io import check_output
from ..io.atomic import OWNER, dead_owner, default_mode, foreign, owner_tag, possible_pid
from ..weights import SPEC_HASH_KEY, check_buffers, spec_metadata
from .sharding import expert_group, expert_slices

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


def save_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *,
               extra: dict | None = None, force: bool = False) -> None:
    """Save model + optimizer state to the folder `path` with torch.distributed.checkpoint (a collective under
    torch.distributed; also works in one process), the experts and their optimizer moments as DTensors sharded
    on the expert axis, so that `load_state` reads it back at any world size. `extra` (step, scheduler state:
    anything JSON holds) is saved beside it, and so is the model's spec. The folder is written whole under a
    temporary name and swapped in: a save that fails or is killed leaves the previous state, or the new one.

    What is at `path` is replaced only when it is a training state that save_state wrote, or an empty folder;
    any other folder only with `force=True`; a file never. A symbolic link at `path` is followed only to a
    state folder (the link stays, the folder it names is replaced); any other link is refused."""
    path = Path(path)
    writer = not dist.is_initialized() or dist.get_rank() == 0
    extra_json = json.dumps(extra or {})  # not JSON: fail before anything is written
    path, tmp = _shared_temp_folder(path, writer, force)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(_training_state(model, optimizer), checkpoint_id=str(tmp))
        if writer:
            spec = getattr(model, "moespec_spec", None)
            try:
                if spec is not None:
                    (tmp / SPEC_FILE).write_text(json.dumps({**spec_metadata(spec), SPEC_NAME_KEY: spec.name}))
                (tmp / EXTRA).write_text(extra_json)  # last: a folder with extra.json in it is complete
            except OSError as error:
                raise CheckpointError(f"{path}: cannot save the training state ({_os_reason(error)}); the "
                                      f"previous state is unchanged") from None
            _swap_in(tmp, path, force)
    except CheckpointException as error:  # DCP's BaseException: a rank could not write its files
        raise _clean_error(path, error, "cannot save the training state",
                           "; the previous state is unchanged") from None
    finally:
        if writer and tmp.exists():  # the save failed: the temp folder is this process's own
            shutil.rmtree(tmp)
    if dist.is_initialized():
        dist.barrier()


def load_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load what `save_state` wrote into `model` and `optimizer` (built for it), at this world size: the model
    sharded like the one saved, over another number of ranks, or not at all. Returns the `extra` dict. A state
    that is incomplete, altered or saved for another model is a `CheckpointError` that names the folder (and,
    for another spec, the spec it was saved with and the first tensor that does not fit)."""
    path = Path(path)
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            _recover(path)
        except OSError:  # a read-only folder: nothing to finish here, read what is there
            pass
    if dist.is_initialized():
        dist.barrier()
    extra, saved, metadata = _on_every_rank(lambda: _read_state_files(path))
    state = _training_state(model, optimizer)
    buffers = {name for name, _ in model.named_buffers()}  # read into copies: checked before the model gets them
    state["model"] = {name: t.clone() if name in buffers and not isinstance(t, DTensor) else t
                      for name, t in state["model"].items()}
    planner = _SafeLoadPlanner(path, _spec_mismatch(saved, getattr(model, "moespec_spec", None)))
    try:
        with warnings.catch_warnings():  # in one process DCP warns that it loads without torch.distributed
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=_SafeReader(path, metadata), planner=planner)
    except CheckpointException as error:
        raise _clean_error(path, error, "cannot read the training state", "; is the folder complete, as save_state "
                                                                          "wrote it?") from None
    loaded = {name: _local(t) for name, t in state["model"].items()}
    check_buffers([(name, loaded[name]) for name, _ in model.named_buffers() if name in loaded], str(path))
    model.load_state_dict(loaded)
    optim = state["optim"]
    optim["state"] = {name: {k: _local(v) for k, v in moments.items()} for name, moments in optim["state"].items()}
    set_optimizer_state_dict(model, optimizer, optim)
    return extra


# -- the swap, and what a killed swap leaves ---------------------------------------------------------------------

def _shared_temp_folder(path: Path, writer: bool, force: bool) -> tuple[Path, Path]:
    """(the folder to replace, the temp folder every rank saves into): rank 0 checks what is at `path`
    (`_state_target`), finishes what a killed save left there and makes the temp folder, its mark in it, and
    sends both names (or its error, so that no rank waits for a name that never comes) to the others."""
    made: list[Any] = [None]
    if writer:
        try:
            target = _state_target(path, force)
            check_output(target, force=True, folder=True)
            _recover(target)
            tmp = tempfile.mkdtemp(prefix=f".{target.name}.{owner_tag()}.", suffix=".tmp",
                                   dir=target.absolute().parent)
            os.chmod(tmp, default_mode(directory=True))
            (Path(tmp) / MARK).write_text(MARK_CONTENTS)
            made = [(target, tmp)]
        except MoespecError as error:
            made = [error]
        except OSError as error:  # no permission, disk full, a file where a folder should be
            made = [CheckpointError(f"{path}: cannot write the training state next to it ({_os_reason(error)})")]
    if dist.is_initialized():
        dist.broadcast_object_list(made, src=0)
    if isinstance(made[0], MoespecError):
        raise made[0]
    return Path(made[0][0]), Path(made[0][1])


def is_state(folder: Path) -> bool:
    """Whether `folder` is a training state that save_state wrote: a real folder with its mark, or one from
    before the mark that holds `extra.json`, `.metadata` and nothing but state files."""
    if not folder.is_dir() or folder.is_symlink():
        return False
    mark = folder / MARK
    if mark.is_file() and not mark.is_symlink():
        return True
    return (folder / EXTRA).is_file() and (folder / METADATA).is_file() and _ours(folder)


def _state_target(path: Path, force: bool) -> Path:
    """The folder a save to `path` replaces: `path`, or the state folder a symbolic link there names. Refused
    (CheckpointError) where that would replace what save_state did not write: a file, a link to anything but a
    state folder, or a folder that is not empty and not a state (without `force`)."""
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        if not is_state(target):
            what = "nothing" if not target.exists() else "a file" if not target.is_dir() else "a folder that is not " \
                                                                                             "a training state"
            raise CheckpointError(f"{path}: a symbolic link to {target}, which is {what}; save_state follows a link "
                                  f"only to a training state's folder. Give the path of a folder to write")
        return target
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} is a file; a training state is a folder, and save_state never replaces a "
                              f"file. Choose another path")
    if path.is_dir() and any(path.iterdir()) and not is_state(path) and not force:
        raise CheckpointError(f"{path}: a folder that is not a training state (it has no {MARK}, which save_state "
                              f"writes); save_state replaces only its own states. Choose another path, or pass "
                              f"force=True to replace this folder and everything in it")
    return path


def _swap_in(tmp: Path, path: Path, force: bool) -> None:
    """Rename the complete folder `tmp` to `path`, the old `path` moved aside first and removed after. Killed
    between the renames, `path` is missing: `_recover` renames `tmp` (complete) there. What is at `path` is
    checked again first: another process may have put something there while the state was written."""
    _state_target(path, force)
    moved = path.exists()
    old = None
    try:
        if moved:  # an empty folder under a name nothing has, that the rename replaces
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-{owner_tag()}.", dir=path.absolute().parent))
            os.replace(path, old)
        os.replace(tmp, path)
    except OSError as error:
        if old is not None and old.exists() and not path.exists():
            os.replace(old, path)
        raise CheckpointError(f"{path}: cannot replace the training state ({_os_reason(error)})") from None
    if moved:
        shutil.rmtree(old)


def _recover(path: Path) -> None:
    """Finish or undo what a save_state killed at any point left next to `path`: the old state moved aside with
    no new one at `path` is replaced by the killed save's complete temp folder (or put back when there is
    none), and the killed save's other folders are removed. Only folders with the names a save gives them,
    named by a process that no longer runs, holding nothing but state files, are touched."""
    olds, temps = _leftovers(path)
    elsewhere = [old for owner, found in olds.items() if foreign(owner[1]) for old in found]
    if elsewhere and not path.exists():
        raise CheckpointError(f"{path}: not there, and {elsewhere[0].name} beside it holds the training state that a "
                              f"save_state on another host moved aside while it replaced it; that save may still "
                              f"be running. If it is not, rename {elsewhere[0].name} back to {path.name}")
    for owner, found in olds.items():
        if foreign(owner[1]) or not dead_owner(*owner):
            continue
        for old in sorted(found, key=lambda f: f.stat().st_mtime, reverse=True):
            complete = [t for t in temps.get(owner, []) if (t / EXTRA).is_file() and (t / METADATA).is_file()]
            if not path.exists() and (complete or any(old.iterdir())):  # empty: made, then killed before the move
                os.replace(complete[0] if complete else old, path)
            if old.exists():
                shutil.rmtree(old)
    for owner, folders in temps.items():
        for tmp in folders:
            if dead_owner(*owner) and tmp.exists():
                shutil.rmtree(tmp)


def _leftovers(path: Path) -> tuple[dict[tuple[str, str | None], list[Path]],
                                    dict[tuple[str, str | None], list[Path]]]:
    """({(pid, host): [old folders]}, {(pid, host): [temp folders]}) next to `path` of save_states that do not
    run on this host (dead here, or on another host: `_recover` leaves those), holding only state files."""
    name = re.escape(f".{path.name}.")
    old_name = re.compile(name + rf"old-{OWNER}(?:\.[a-z0-9_]{{8}})?\Z")  # mkdtemp's 8 random, or none (older)
    temp_name = re.compile(name + rf"{OWNER}\.[a-z0-9_]{{8}}\.tmp\Z")
    olds: dict[tuple[str, str | None], list[Path]] = {}
    temps: dict[tuple[str, str | None], list[Path]] = {}
    parent = path.absolute().parent
    if not parent.is_dir():
        return olds, temps
    for entry in parent.iterdir():
        match = old_name.match(entry.name) or temp_name.match(entry.name)
        if match is None or not possible_pid(match[1]) or not (foreign(match[2]) or dead_owner(match[1], match[2])) \
                or not _ours(entry):
            continue
        (olds if match.re is old_name else temps).setdefault((match[1], match[2]), []).append(entry)
    return olds, temps


def _ours(folder: Path) -> bool:
    """A real folder holding only files a save writes (or nothing yet)."""
    return (folder.is_dir() and not folder.is_symlink()
            and all(STATE_FILE.match(f.name) and f.is_file() and not f.is_symlink() for f in folder.iterdir()))


# -- reading what a folder holds, trusting none of it ----------------------------------------------------------

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


def _clean_error(path: Path, error: CheckpointException, what: str, hint: str = "") -> CheckpointError:
    """One CheckpointError for DCP's CheckpointException (a BaseException holding each rank's failure): ours
    as it is, or the first rank's, in one line."""
    failures = [error.failures[rank][0] for rank in sorted(error.failures)]
    ours = next((f for f in failures if isinstance(f, MoespecError)), None)
    if ours is not None:
        return CheckpointError(str(ours))
    first = failures[0] if failures else error
    if any(_out_of_space(f) for f in failures):  # torch's writer says "enforce fail at inline_container.cc"
        return CheckpointError(f"{path}: {what}: no space left on the device{hint}")
    return CheckpointError(f"{path}: {what} ({type(first).__name__}: {_gist(first)}){hint}")


def _out_of_space(error: BaseException) -> bool:
    """Whether a rank's failure is a full disk: ENOSPC, or torch's zip writer failing on a short write."""
    while error is not None:
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(error) or "inline_container" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _os_reason(error: OSError) -> str:
    """Why a write failed, in words; a full disk said plainly."""
    if error.errno == errno.ENOSPC:
        return "no space left on the device"
    return error.strerror or str(error)


def _gist(error: BaseException) -> str:
    """An exception's message in one short line: the reason torch.load's weights-only unpickler gives, or the
    first sentence of the first line."""
    text = str(error)
    reason = re.search(r"WeightsUnpickler error:\s*(\S.*)", text)
    line = reason[1] if reason else next((line.strip() for line in text.splitlines() if line.strip()), "")
    return line.split(". ")[0][:160] or type(error).__name__


# -- the state dict --------------------------------------------------------------------------------------------

def _training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"model", "optim"} state dicts by parameter name; under expert parallelism the sharded tensors are
    wrapped as DTensors on a 1-D mesh of the expert group."""
    slices = expert_slices(model)
    optim = get_optimizer_state_dict(model, optimizer)
    model_state = model.state_dict()
    if not slices:
        return {"model": model_state, "optim": optim}
    mesh = DeviceMesh.from_group(expert_group(model), next(model.parameters()).device.type)
    model_state = {name: _sharded(t, mesh) if name in slices else t for name, t in model_state.items()}
    optim["state"] = {name: {k: _sharded(v, mesh) if name in slices and torch.is_tensor(v) and v.dim() else v
                             for k, v in moments.items()} for name, moments in optim["state"].items()}
    return {"model": model_state, "optim": optim}


def _sharded(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    world = mesh.size()
    shape = (local.shape[0] * world, *local.shape[1:])
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


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
import json
import os
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..errors import CheckpointError, MoespecError
from ..io import check_output
from ..io.atomic import OWNER, dead_owner, default_mode, foreign, owner_tag, possible_pid
from ..io.lock import output_lock
from ..weights import check_buffers, spec_metadata
from ..weights.checkpoint import unwrapped
from .sharding import expert_group, expert_slices
from .state_reading import (
    EXTRA,
    MARK,
    MARK_CONTENTS,
    METADATA,
    SPEC_FILE,
    SPEC_NAME_KEY,
    STATE_FILE,
    _gist,
    _on_every_rank,
    _read_state_files,
    _SafeLoadPlanner,
    _SafeReader,
    _spec_mismatch,
)


def save_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *,
               extra: dict | None = None, force: bool = False) -> None:
    """Save model + optimizer state to the folder `path` with torch.distributed.checkpoint (a collective under
    torch.distributed; also works in one process), the experts and their optimizer moments as DTensors sharded
    on the expert axis, so that `load_state` reads it back at any world size. `extra` (step, scheduler state:
    anything JSON holds) is saved beside it, and so is the model's spec. The folder is written whole under a
    temporary name and swapped in: a save that fails or is killed leaves the previous state, or the new one.
    Of two saves to one path at once, the one that finishes last is what the folder holds, whole.

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
            spec = getattr(unwrapped(model), "moespec_spec", None)
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
    state, layouts = _training_state(model, optimizer, layouts=True)
    inner = unwrapped(model)
    buffers = {name for name, _ in inner.named_buffers()}  # read into copies: checked before the model gets them
    state["model"] = {name: t.clone() if name in buffers and not isinstance(t, DTensor) else t
                      for name, t in state["model"].items()}
    planner = _SafeLoadPlanner(path, _spec_mismatch(saved, getattr(inner, "moespec_spec", None)))
    try:
        with warnings.catch_warnings():  # in one process DCP warns that it loads without torch.distributed
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=_SafeReader(path, metadata), planner=planner)
    except CheckpointException as error:
        raise _clean_error(path, error, "cannot read the training state", "; is the folder complete, as save_state "
                                                                          "wrote it?") from None
    loaded = {name: _placed(t, layouts, name) for name, t in state["model"].items()}
    check_buffers([(name, _local(loaded[name])) for name, _ in inner.named_buffers() if name in loaded], str(path))
    set_model_state_dict(model, loaded)
    optim = state["optim"]
    optim["state"] = {name: {k: _placed(v, layouts, name) if torch.is_tensor(v) and v.dim() else v
                             for k, v in moments.items()} for name, moments in optim["state"].items()}
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
            with output_lock(target):  # two saves at once never both finish what a killed one left
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
    between the renames, `path` is missing: `_recover` renames `tmp` (complete) there. The output's lock is
    held throughout (`lock.output_lock`): of two saves to one path, the second swaps its folder in after the
    first, never between its check of `path` and its renames. What is at `path` is checked again under it:
    another process may have put something there while the state was written."""
    with output_lock(path):
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


# -- the state dict --------------------------------------------------------------------------------------------

def _training_state(model: nn.Module, optimizer: torch.optim.Optimizer, layouts: bool = False):
    """{"model", "optim"} state dicts by parameter name, as DCP saves them at any world size: a DDP's inner
    names, FSDP2's DTensors as they are; under expert parallelism the sharded experts (made whole over their
    replicas first where FSDP2 shards them, `parallelize(..., data="fsdp")`) wrapped as DTensors sharded on the
    expert axis over a 1-D mesh of the expert group (every group writes the same, which DCP writes once).
    With `layouts`, also {name: (mesh, placements) where FSDP2 shards it, else None} of the sharded experts,
    to put them back (`_placed`)."""
    inner = unwrapped(model)
    slices = expert_slices(inner)
    optim = get_optimizer_state_dict(model, optimizer)
    model_state = get_model_state_dict(model)
    found: dict[str, tuple] = {}
    if slices:
        mesh = DeviceMesh.from_group(expert_group(inner), next(inner.parameters()).device.type)
        for name in slices:
            t = model_state[name]
            found[name] = (t.device_mesh, t.placements) if isinstance(t, DTensor) else None
        model_state = {name: _sharded(_whole(t), mesh) if name in slices else t for name, t in model_state.items()}
        optim["state"] = {name: {k: _sharded(_whole(v), mesh) if name in slices and torch.is_tensor(v) and v.dim()
                                 else v for k, v in moments.items()} for name, moments in optim["state"].items()}
    state = {"model": model_state, "optim": optim}
    return (state, found) if layouts else state


def _whole(t: torch.Tensor) -> torch.Tensor:
    """An FSDP2-sharded tensor gathered over its mesh (a collective); a plain one as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _placed(t, layouts: dict[str, tuple | None], name: str):
    """A loaded tensor as the model holds it: an expert shard as this rank's local tensor, sharded again where
    FSDP2 shards it (its mesh and placements; every replica read the same, so no data moves); the rest as DCP
    read it (FSDP2's own DTensors, or plain tensors)."""
    if name not in layouts:
        return t
    layout = layouts[name]
    return _local(t) if layout is None else distribute_tensor(_local(t), layout[0], layout[1], src_data_rank=None)


def _sharded(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    world = mesh.size()
    shape = (local.shape[0] * world, *local.shape[1:])
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


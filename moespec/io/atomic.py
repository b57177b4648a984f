"""Writes that never leave a half-written output: temp file (or folder) in the target folder, fsync, rename.

One check says "exists; pass --force" for every output (`check_output`), and one helper writes every output
(`atomic_output`), file or folder; its two halves (`temp_output`, `commit`) serve writes of several files.
Temp files left by a writer that was killed are removed by the next write to the same path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from ..errors import MoespecError


def check_output(path: str | Path, force: bool, *, folder: bool = False) -> Path:
    """Fail before any work if `path` cannot be written: it exists and `force` is not given (a report folder
    may exist empty), it is a folder where a file should go (or the reverse), or its parent folder neither
    exists nor can be created (it is created, like `mkdir -p`)."""
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise MoespecError(f"{path} is a file; the report is a folder")
    if not folder and path.is_dir():
        raise MoespecError(f"{path} is a folder; the output is a file (for example {path / 'model.safetensors'})")
    taken = path.exists() and not (folder and not any(path.iterdir()))
    if taken and not force:
        what = " and is not empty; pass --force to replace it" if folder else "; pass --force to overwrite it"
        raise MoespecError(f"{path} already exists{what}")
    parent = path.absolute().parent
    if not parent.is_dir():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:  # a file where a folder should be, or no permission
            blocker = next((p for p in [path.parent, *path.parent.parents] if p.exists() and not p.is_dir()), None)
            why = f"{blocker} is a file, not a folder" if blocker is not None else err.strerror or str(err)
            raise MoespecError(f"{path.parent}: cannot create the output's folder ({why})") from None
    return path


@contextlib.contextmanager
def atomic_output(path: str | Path, *, force: bool = False, folder: bool = False) -> Iterator[Path]:
    """Yield a temp path (a file, or an empty folder with `folder`) next to `path`; on success make it whole
    on disk and rename it to `path`, replacing what was there only with `force` (`check_output`).

    On any error the temp output is removed; the previous `path`, if any, is untouched.
    """
    path = check_output(path, force, folder=folder)
    with temp_output(path, folder=folder) as tmp:
        yield tmp
        if folder:
            _replace_folder(tmp, path)
        else:
            commit(tmp, path)


@contextlib.contextmanager
def temp_output(path: Path, *, folder: bool = False) -> Iterator[Path]:
    """A new temp file (or empty folder) next to `path`, `.{name}.{pid}.*.tmp`, so that the next write to
    `path` removes it if this process dies; removed on exit unless `commit` renamed it. A folder where it
    cannot be made (no permission, disk full) is a user's problem: `MoespecError`."""
    remove_stale_temp_files(path)
    prefix, parent = f".{path.name}.{os.getpid()}.", path.absolute().parent
    try:
        if folder:
            tmp = tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=parent)
        else:
            fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=parent)
            os.close(fd)
    except OSError as err:
        raise MoespecError(f"{path.parent}: cannot write files in this folder ({err.strerror or err})") from None
    os.chmod(tmp, default_mode(directory=folder))  # mkstemp / mkdtemp make it private; outputs get the umask's
    try:
        yield Path(tmp)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        elif os.path.exists(tmp):
            os.remove(tmp)


def commit(tmp: Path, path: Path) -> None:
    """Make the complete temp file `tmp` whole on disk and rename it to `path` (atomic: a reader sees the
    old `path` or the new one)."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _replace_folder(new: Path, path: Path) -> None:
    """Rename the complete folder `new` to `path`; an old `path` is moved aside first and removed after."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
    os.replace(new, path)
    if old is not None:
        shutil.rmtree(old)


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



"""Writes that never leave a half-written output: temp file (or folder) in the target folder, fsync, rename.

One check says "exists; pass --force" for every output (`check_output`), and one helper writes every output
(`atomic_output`), file or folder. Temp files left by a writer that was killed are removed by the next write
to the same path.
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
    may exist empty), or its parent folder neither exists nor can be created (it is created, like `mkdir -p`)."""
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise MoespecError(f"{path} is a file; the report is a folder")
    taken = path.exists() and not (folder and not any(path.iterdir()))
    if taken and not force:
        what = " and is not empty; pass --force to replace it" if folder else "; pass --force to overwrite it"
        raise MoespecError(f"{path} already exists{what}")
    parent = path.absolute().parent
    if not parent.is_dir():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:  # a file where a folder should be, or no permission
            raise MoespecError(f"{path.parent}: cannot create the output's folder ({err.strerror or err})") from None
    return path


@contextlib.contextmanager
def atomic_output(path: str | Path, *, force: bool = False, folder: bool = False) -> Iterator[Path]:
    """Yield a temp path (a file, or an empty folder with `folder`) next to `path`; on success make it whole
    on disk and rename it to `path`, replacing what was there only with `force` (`check_output`).

    On any error the temp output is removed; the previous `path`, if any, is untouched.
    """
    path = check_output(path, force, folder=folder)
    remove_stale_temp_files(path)
    prefix, parent = f".{path.name}.{os.getpid()}.", path.absolute().parent
    if folder:
        tmp = tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=parent)
    else:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=parent)
        os.close(fd)
    os.chmod(tmp, default_mode(directory=folder))  # mkstemp / mkdtemp make it private; outputs get the umask's
    try:
        yield Path(tmp)
        if folder:
            _replace_folder(Path(tmp), path)
        else:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        elif os.path.exists(tmp):
            os.remove(tmp)


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



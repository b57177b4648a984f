"""Writes that never leave a half-written output: temp file (or folder) in the target folder, fsync, rename.

One check says "exists; pass --force" for every output (`check_output`), and one helper writes every output
(`atomic_output`), file or folder; its two halves (`temp_output`, `commit`) serve writes of several files.
Temp files left by a writer that was killed are removed by the next write to the same path, and a folder it
was replacing is put back by the next check of that path. One writer at a time holds the output (`lock`).

Which leftovers are a killed writer's is told by their names: each carries its writer's pid and host
(`owner_tag`: `{pid}@{host}`, the host as 8 hex digits of its name's sha256). A leftover is stale when its
writer ran on this host and its pid no longer runs there. A leftover of another host (a folder shared over
NFS) is never removed or moved, whatever its pid: a pid says nothing about a process on another machine.
Where one blocks a write (the folder a writer on another host moved aside while it replaced the output, with
no output left at the path), the write is refused with a message that names it. Names without a host (from
moespec before host tags) are taken for this host's.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import glob
import hashlib
import os
import random
import re
import shutil
import socket
import string
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from ..errors import MoespecError
from .lock import lock_file, output_lock

WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}  # a write's errors that the user must fix

HOST_TAG = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
OWNER = r"(\d+)(?:@([0-9a-f]{8}))?"
"""A leftover's writer in its name: its pid and host (`owner_tag`); no host: a name from before host tags."""


def owner_tag() -> str:
    """How this process names its leftovers: `{pid}@{host}`, the host as 8 hex digits of its name's sha256."""
    return f"{os.getpid()}@{HOST_TAG}"


def foreign(host: str | None) -> bool:
    """Whether a leftover whose name carries `host` (None: no host) was written on another host."""
    return host is not None and host != HOST_TAG


PID_MAX = 2**22
"""Linux's largest pid (PID_MAX_LIMIT): a name of this host's with a pid above it is no writer's of this host."""


def possible_pid(pid: str) -> bool:
    """Whether `pid` (digits from a leftover's name) can be a process's on any host: a positive pid_t (32-bit). A
    name with another (0, 4294967296) is not a moespec writer's, whatever else it looks like: it is never
    removed, moved or counted."""
    return len(pid) <= 10 and 0 < int(pid) < 2**31


def dead_owner(pid: str, host: str | None) -> bool:
    """Whether the writer named `{pid}@{host}` is gone: it ran on this host and its pid, one this host can have
    (up to `PID_MAX`), no longer runs here. A writer on another host is never taken for dead."""
    return possible_pid(pid) and int(pid) <= PID_MAX and not foreign(host) and not _alive(int(pid))


def check_output(path: str | Path, force: bool, *, folder: bool = False,
                 ours: Callable[[Path], str | None] | None = None) -> Path:
    """Fail before any work if `path` cannot be written: it exists and `force` is not given (a report folder
    may exist empty), it is a folder where a file should go (or the reverse), or its parent folder neither
    exists nor can be created (it is created, like `mkdir -p`). A name that cannot be shown on one line (a
    control character, bytes that are not UTF-8) is refused first. A folder is written whole in place of its
    path, so it is never the working directory or one that holds it (`-o .`, `-o ..`), nor an empty path; and
    with `ours` (the folder -> why it is not this writer's, or None), `force` replaces only a folder `ours`
    accepts. A report folder that a killed write was replacing is put back first (`_restore_folder`)."""
    if folder and not str(path).strip():  # Path("") is Path("."): say what was given
        raise MoespecError(f"{str(path)!r}: not a folder's name; name the folder to write (for example my-model)")
    path = check_name(path)
    if folder:
        _check_own_folder(path)
        _restore_folder(path)
    return _check_output(path, force, folder, ours)


def _check_own_folder(path: Path) -> None:
    where, here = Path(os.path.abspath(path)), Path(os.getcwd())
    if where == here or where in here.parents:
        what = "the working directory" if where == here else f"a folder that holds the working directory ({here})"
        raise MoespecError(f"{path}: {what}; an output folder is written whole in place of its path, so it must be a "
                           f"folder of its own: name a new one (for example {path / 'my-model'})")


def _check_output(path: Path, force: bool, folder: bool, ours: Callable[[Path], str | None] | None = None) -> Path:
    if folder and path.is_symlink():  # replacing it would replace the link, and leave the folder it names
        raise MoespecError(f"{path} is a symbolic link (to {os.readlink(path)}); a report folder is written under "
                           f"its own name, never through a link. Name the folder itself, or another one")
    if folder and path.exists() and not path.is_dir():
        raise MoespecError(f"{path} is a file; the report is a folder")
    if not folder and path.is_dir():
        raise MoespecError(f"{path} is a folder; the output is a file (for example {path / 'model.safetensors'})")
    taken = path.exists() and not (folder and not any(path.iterdir()))
    if taken and ours is not None and (why := ours(path)) is not None:
        raise MoespecError(f"{path}: a folder that moespec did not write: {why}. --force replaces only a folder "
                           f"moespec wrote, never one of your files; choose another folder")
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


def check_name(path: str | Path) -> Path:
    """`path`, unless it holds a control character (a newline) or bytes that are not UTF-8: such a name would
    break the one-line messages that name it, and the file lists of other tools."""
    text = str(path)
    odd = next((c for c in text if ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF), None)
    if odd is not None:
        what = "bytes that are not UTF-8" if ord(odd) >= 0xD800 else f"a control character ({odd!r})"
        raise MoespecError(f"{ascii(text)}: the output's name holds {what}; choose a plain name")
    return Path(path)


@contextlib.contextmanager
def atomic_output(path: str | Path, *, force: bool = False, folder: bool = False,
                  ours: Callable[[Path], str | None] | None = None) -> Iterator[Path]:
    """Yield a temp path (a file, or an empty folder with `folder`) next to `path`; on success make it whole
    on disk and rename it to `path`, replacing what was there only with `force` (`check_output`).

    On any error the temp output is removed; the previous `path`, if any, is untouched. An OSError while the
    output is written or renamed that only the user can fix (a full disk: `WRITE_ERRNOS`) is a `MoespecError`
    that names `path`. The output's lock is
    held throughout (`lock.output_lock`), and `path` is checked again under it: of two writers at once, the
    second waits for the first, then replaces its output only with `force`.
    """
    path = check_output(path, force, folder=folder, ours=ours)
    with output_lock(path):
        if folder:
            _restore_folder(path, locked=True)
        _check_output(path, force, folder, ours)
        with temp_output(path, folder=folder) as tmp:
            try:
                yield tmp
                if folder:
                    _replace_folder(tmp, path)
                else:
                    commit(tmp, path)
            except MoespecError as err:  # a writer's error names the temp output: name the output instead
                if type(err) is not MoespecError or str(tmp) not in str(err):
                    raise
                raise MoespecError(str(err).replace(str(tmp), str(path))) from None
            except OSError as err:  # a full disk, a file system made read-only meanwhile: the user's to fix
                if err.errno not in WRITE_ERRNOS:
                    raise
                raise MoespecError(f"{path}: cannot write it ({err.strerror or err}); the output there before, if "
                                   f"any, is what a reader still gets") from None


@contextlib.contextmanager
def temp_output(path: Path, *, folder: bool = False) -> Iterator[Path]:
    """A new temp file (or empty folder) next to `path`, `.{name}.{pid}@{host}.*.tmp`, so that the next write
    to `path` removes it if this process dies; removed on exit unless `commit` renamed it. A folder where it
    cannot be made (no permission, disk full) is a user's problem: `MoespecError`."""
    remove_stale_temp_files(path)
    prefix, parent = f".{path.name}.{owner_tag()}.", path.absolute().parent
    try:
        if folder:
            tmp = str(_marked_folder(parent, prefix))
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
        if folder:
            _mark(Path(tmp)).unlink(missing_ok=True)


def commit(tmp: Path, path: Path) -> None:
    """Make the complete temp file `tmp` whole on disk and rename it to `path` (atomic: a reader sees the
    old `path` or the new one)."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _replace_folder(new: Path, path: Path) -> None:
    """Rename the complete folder `new` to `path`. An old folder at `path` is swapped with `new` in one step
    where the system can (`_exchange`): `new`, this writer's marked temp folder, then holds the old one, which
    `temp_output` removes (or, killed first, the next write). Elsewhere the old `path` is moved aside first, to
    a free name `.{name}.old-{pid}@{host}[-xxxxxxxx]` (marked as this writer's: `_mark`), and removed after.
    Killed between those two renames, the old folder is put back by the next check of `path`
    (`_restore_folder`); killed after them, the next write removes it."""
    if path.is_dir() and not path.is_symlink() and _exchange(new, path):
        return
    old = None
    if path.exists():
        old = _aside_folder(path)
        os.replace(path, old)
    os.replace(new, path)
    _mark(new).unlink(missing_ok=True)
    if old is not None:
        if old.is_symlink():  # a link that was at the path: removed, never followed
            old.unlink()
        else:
            shutil.rmtree(old)
        _mark(old).unlink(missing_ok=True)


_RENAME_EXCHANGE = 2  # linux/fs.h: renameat2 swaps the two names atomically
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names `a` and `b` in one atomic step (Linux's `renameat2(RENAME_EXCHANGE)`, which `os` does not
    offer), so that no moment has neither at `b`; False where the system or the file system cannot (then
    nothing changed)."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):  # no such call or flag here
        return False
    raise OSError(err, os.strerror(err), str(b))


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


WRITER_MARK = ".writing"  # `X.writing` beside a folder X: X is a moespec writer's own (its temp or moved-aside old)


def _mark(folder: Path) -> Path:
    """The file whose presence says that `folder` is a writer's own: a temp folder it made, or the old output it
    moved aside. A folder of the same name without it (a user's, a planted one) is never removed or moved."""
    return folder.with_name(folder.name + WRITER_MARK)


def _marked_folder(parent: Path, prefix: str) -> Path:
    """A new empty folder `{prefix}xxxxxxxx.tmp` in `parent`, its mark made first (so that a writer killed in
    between leaves a mark without a folder, which the next write removes, never an unmarked folder)."""
    for _ in range(100):
        folder = parent / f"{prefix}{''.join(random.choices(string.ascii_lowercase + string.digits, k=8))}.tmp"
        try:
            fd = os.open(_mark(folder), os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue
        os.close(fd)
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            _mark(folder).unlink()
            continue
        return folder
    raise FileExistsError(f"{parent}: no free temp folder name for {prefix}")


def _aside_folder(path: Path) -> Path:
    """A name that nothing has, `.{name}.old-{pid}@{host}` or with `-xxxxxxxx` after it, for the old folder at
    `path`, its mark made first (exclusively: a folder already there under that name is never taken over)."""
    for attempt in range(100):
        suffix = "" if attempt == 0 else "-" + "".join(random.choices(string.ascii_lowercase + string.digits, k=8))
        old = path.with_name(f".{path.name}.old-{owner_tag()}{suffix}")
        try:
            fd = os.open(_mark(old), os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue
        os.close(fd)
        if not os.path.lexists(old):
            return old
        _mark(old).unlink()
    raise FileExistsError(f"{path.parent}: no free name to move {path.name} aside")


_OLD_SUFFIX = re.compile(rf"\.old-{OWNER}(?:-[a-z0-9]{{8}})?")  # what `_aside_folder` adds to `.{name}`


def _writers_folders(path: Path) -> list[tuple[Path, bool]]:
    """(folder, its writer is on another host) for the folders `.{name}.old-...` next to `path` that a writer
    not running on this host moved aside (`_replace_folder`), marked as its own."""
    found = []
    for old in path.parent.glob(f".{glob.escape(path.name)}.old-*"):
        match = _OLD_SUFFIX.fullmatch(old.name[len(path.name) + 1:])
        if match is not None and possible_pid(match[1]) and old.is_dir() and not old.is_symlink() \
                and _mark(old).is_file() and (foreign(match[2]) or dead_owner(match[1], match[2])):
            found.append((old, foreign(match[2])))
    return found


def _dead_writers_folders(path: Path) -> list[Path]:
    """The folders next to `path` that a writer now dead, on this host, moved aside (`_replace_folder`)."""
    return [old for old, elsewhere in _writers_folders(path) if not elsewhere]


def _restore_folder(path: Path, *, locked: bool = False) -> None:
    """Undo what a writer killed while it wrote the folder `path` left: with no folder at `path`, put back the
    one it moved aside (`_replace_folder`), else remove that one; remove its temp folder, and its lock file.
    Only what has the names a writer of `path` gives and a dead writer's pid. Under the output's lock
    (`locked`: the caller holds it)."""
    if not path.parent.is_dir():
        return
    elsewhere = [old for old, foreign_host in _writers_folders(path) if foreign_host]
    if elsewhere and not os.path.lexists(path):
        raise MoespecError(f"{path}: not there, and {elsewhere[0].name} beside it holds the folder that a moespec "
                           f"process on another host moved aside while it replaced it; that process may still be "
                           f"writing. If it is not, rename {elsewhere[0].name} back to {path.name} (or remove it), "
                           f"then run this again")
    left = _dead_writers_folders(path) or _stale_temp_files(path) or _stale_marks(path)
    if not (left or os.path.lexists(lock_file(path))):
        return
    with contextlib.nullcontext() if locked else output_lock(path):
        for old in sorted(_dead_writers_folders(path), key=lambda p: p.stat().st_mtime, reverse=True):
            if not os.path.lexists(path):
                os.replace(old, path)
            else:
                with contextlib.suppress(OSError):  # another user's, in a sticky folder: theirs to remove
                    shutil.rmtree(old)
            with contextlib.suppress(OSError):
                _mark(old).unlink()
        remove_stale_temp_files(path)


def default_mode(directory: bool = False) -> int:
    """The permissions a new file (or folder) gets from the umask; temp files start private (0600 / 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


_TEMP_SUFFIX = re.compile(rf"\.{OWNER}\.[a-z0-9_]{{8}}\.tmp")  # what `temp_output` adds to `.{name}`: owner, 8 random


def remove_stale_temp_files(path: Path) -> list[Path]:
    """Remove the temp files (and folders) `.{name}.{pid}@{host}.xxxxxxxx.tmp` next to `path` whose writing
    process, on this host, no longer runs; another host's are never removed. One that this user may not remove
    (another user's, in a sticky folder) is left alone."""
    removed = []
    for tmp in _stale_temp_files(path):
        try:
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp)
                _mark(tmp).unlink(missing_ok=True)
            else:
                tmp.unlink(missing_ok=True)
        except PermissionError:
            continue
        removed.append(tmp)
    for mark in _stale_marks(path):  # of a folder already gone: the writer was killed before or after it
        with contextlib.suppress(OSError):
            mark.unlink()
    return removed


def _stale_temp_files(path: Path) -> list[Path]:
    """The temp files and folders (`temp_output`) next to `path` of writers that no longer run."""
    stale = []
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        match = _TEMP_SUFFIX.fullmatch(tmp.name[len(path.name) + 1:])
        if match is not None and dead_owner(match[1], match[2]) and (not tmp.is_dir() or _mark(tmp).is_file()):
            stale.append(tmp)
    return stale


def _stale_marks(path: Path) -> list[Path]:
    """Marks (`_mark`) next to `path` of dead writers whose folder no longer exists."""
    found = []
    for mark in path.parent.glob(f".{glob.escape(path.name)}.*{WRITER_MARK}"):
        folder = mark.with_name(mark.name[: -len(WRITER_MARK)])
        rest = folder.name[len(path.name) + 1:]
        match = _TEMP_SUFFIX.fullmatch(rest) or _OLD_SUFFIX.fullmatch(rest)
        if match is not None and dead_owner(match[1], match[2]) and not os.path.lexists(folder):
            found.append(mark)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True



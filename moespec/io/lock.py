"""One writer per output at a time: an advisory lock file next to the output, `.{name}.lock`, held for the whole
write and naming its owner (pid and host).

The lock is an `flock` on that file, which the kernel drops when its owner dies however it dies: the file a
killed writer left is taken over by the next one, and the pid in it only serves to name the owner in the
error that a second writer gets. The owner removes the file when it is done; a writer that waited on the
removed file sees that it is no longer the one at the lock's path and tries again.

The name is made with `O_CREAT | O_EXCL | O_NOFOLLOW`; a file already there is taken over only when it is a
plain file holding what a lock holds (a pid and a host, or nothing yet). Anything else at the name (a symbolic
link, a fifo, a device, a folder, a file with other contents or other names) is not moespec's: it is named in
the error, never opened for writing, followed, truncated or removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path
from typing import Iterator

from ..errors import MoespecError
from ..files import planted_kind

LOCK_WAIT_SECONDS = 10.0
"""How long a second writer waits for the first before it is refused."""
MAX_LOCK_BYTES = 4096  # a lock file holds a pid and a host name; a bigger one is not a lock
_FLAGS = os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def lock_file(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


@contextlib.contextmanager
def output_lock(path: str | Path, *, wait: float = LOCK_WAIT_SECONDS) -> Iterator[None]:
    """Hold the lock of the output `path` while the block runs; waits up to `wait` seconds for another writer,
    then refuses with a `MoespecError` that names it. Something at the lock's name that is not a lock file
    is refused at once, named (`planted_kind`)."""
    lock = lock_file(Path(path))
    deadline = time.monotonic() + wait
    while True:
        fd = _open(lock, path)
        try:
            if _try_lock(lock, fd) and _still_at(lock, fd):
                _check_lock_contents(lock, fd, path)
                break
            owner = _owner(fd)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        if time.monotonic() >= deadline:
            raise MoespecError(f"{path}: {owner} is writing it (lock {lock.name}); wait for it to finish "
                               f"or stop it, then try again") from None
        time.sleep(0.05)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):  # someone else's lock file in a sticky folder: theirs to remove
            if _still_at(lock, fd):  # never a name that something else took meanwhile
                os.unlink(lock)  # before the unlock: a writer that waited on this file then sees it gone
        os.close(fd)


def _planted(lock: Path, path: str | Path, what: str) -> MoespecError:
    return MoespecError(f"{lock}: {what} is at the name of {Path(path).name}'s lock file, which moespec did not "
                        f"make; it is left as it is. Remove it, or write the output under another name")


def _open(lock: Path, path: str | Path) -> int:
    """A descriptor of the lock file: made new (`O_EXCL`), or the plain file a killed writer left (never
    following a link, never opening a fifo, device or folder)."""
    while True:
        try:
            return os.open(lock, _FLAGS | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
        except OSError as err:
            raise MoespecError(f"{lock}: cannot make the output's lock file ({err.strerror or err})") from None
        try:
            found = os.lstat(lock)
        except FileNotFoundError:  # its owner removed it meanwhile: make it
            continue
        except OSError as err:
            raise MoespecError(f"{lock}: cannot read the output's lock file ({err.strerror or err})") from None
        if not stat.S_ISREG(found.st_mode):
            raise _planted(lock, path, planted_kind(found.st_mode))
        try:
            fd = os.open(lock, _FLAGS)
        except FileNotFoundError:
            continue
        except OSError as err:
            if err.errno == errno.ELOOP:  # a link put there since the lstat
                raise _planted(lock, path, "a symbolic link") from None
            raise MoespecError(f"{lock}: cannot take the output's lock file ({err.strerror or err}); another "
                               f"user's writer may hold it") from None
        opened = os.fstat(fd)
        if not os.path.samestat(opened, found) or not stat.S_ISREG(opened.st_mode):
            os.close(fd)
            continue  # replaced between the two looks: look again
        return fd


def _check_lock_contents(lock: Path, fd: int, path: str | Path) -> None:
    """Refuse a plain file at the lock's name that is not a lock: other contents, or other names (a hard link
    to a file elsewhere, whose contents the lock would overwrite)."""
    status = os.fstat(fd)
    if status.st_nlink > 1:
        raise _planted(lock, path, f"a file with {status.st_nlink} names (hard links)")
    data = os.pread(fd, MAX_LOCK_BYTES + 1, 0)
    if data and _lock_owner(data) is None:
        raise _planted(lock, path, f"a file of {status.st_size} bytes that is not a lock (a pid and a host)")


def _try_lock(lock: Path, fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise MoespecError(f"{lock}: cannot lock it ({err.strerror or err}; a file system without locks?)") from None
    return True


def _still_at(lock: Path, fd: int) -> bool:
    """Whether the locked file is still the one at `lock` (its owner removes it before it unlocks)."""
    try:
        return os.path.samestat(os.lstat(lock), os.fstat(fd))
    except FileNotFoundError:
        return False


def _lock_owner(data: bytes) -> tuple[int, str] | None:
    """(pid, host) that a lock file's contents name; None for contents that are not a lock's."""
    try:
        owner = json.loads(data) if len(data) <= MAX_LOCK_BYTES else None
        if not isinstance(owner, dict) or set(owner) != {"pid", "host"} or type(owner["pid"]) is not int:
            return None
        return owner["pid"], str(owner["host"])[:100]
    except (ValueError, TypeError, RecursionError):
        return None


def _owner(fd: int) -> str:
    """"another moespec process (pid N on host H)", from what the open lock file says (read bounded)."""
    try:
        owner = _lock_owner(os.pread(fd, MAX_LOCK_BYTES + 1, 0))
    except OSError:
        owner = None
    if owner is None:
        return "another moespec process"
    return f"another moespec process (pid {owner[0]} on host {owner[1]!r})"

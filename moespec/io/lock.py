"""One writer per output at a time: an advisory lock file next to the output, `.{name}.lock`, held for the whole
write and naming its owner (pid and host).

The lock is an `flock` on that file, which the kernel drops when its owner dies however it dies: the file a
killed writer left is taken over by the next one, and the pid in it only serves to name the owner in the
error that a second writer gets. The owner removes the file when it is done; a writer that waited on the
removed file sees that it is no longer the one at the lock's path and tries again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from ..errors import MoespecError

LOCK_WAIT_SECONDS = 10.0
"""How long a second writer waits for the first before it is refused."""
MAX_LOCK_BYTES = 4096  # a lock file holds a pid and a host name; a bigger one is not read


def lock_file(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


@contextlib.contextmanager
def output_lock(path: str | Path, *, wait: float = LOCK_WAIT_SECONDS) -> Iterator[None]:
    """Hold the lock of the output `path` while the block runs; waits up to `wait` seconds for another writer,
    then refuses with a `MoespecError` that names it."""
    lock = lock_file(Path(path))
    deadline = time.monotonic() + wait
    while True:
        fd = _open(lock)
        try:
            if _try_lock(lock, fd) and _still_at(lock, fd):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        if time.monotonic() >= deadline:
            raise MoespecError(f"{path}: {_owner(lock)} is writing it (lock {lock.name}); wait for it to finish "
                               f"or stop it, then try again") from None
        time.sleep(0.05)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
        yield
    finally:
        with contextlib.suppress(OSError):  # someone else's lock file in a sticky folder: theirs to remove
            os.unlink(lock)  # before the unlock: a writer that waited on this file then sees it gone
        os.close(fd)


def _open(lock: Path) -> int:
    try:
        return os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as err:
        raise MoespecError(f"{lock}: cannot take the output's lock file ({err.strerror or err}); another user's "
                           f"writer may hold it") from None


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
        return os.path.samestat(os.stat(lock), os.fstat(fd))
    except FileNotFoundError:
        return False


def _owner(lock: Path) -> str:
    """"another moespec process (pid N on host H)", from what the lock file says (read bounded)."""
    try:
        with open(lock, "rb") as f:
            owner = json.loads(f.read(MAX_LOCK_BYTES))
        pid, host = int(owner["pid"]), str(owner["host"])[:100]
    except (OSError, ValueError, KeyError, TypeError):
        return "another moespec process"
    return f"another moespec process (pid {pid} on host {host!r})"

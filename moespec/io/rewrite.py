"""Rewriting a file in place (`moespec validate --fix`), only while it still holds what was read: an editor that
saved it meanwhile is never overwritten."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ..errors import MoespecError
from . import atomic
from .lock import output_lock


def rewrite_file(path: Path, data: bytes, expected: bytes, before: os.stat_result) -> None:
    """Replace the file `path`, which held `expected` and was the file `before` describes (its `os.stat` from
    before the caller read it) with `data` (atomically, its permissions kept), only if it still holds
    `expected` and is still the same file at the rename: an editor
    that saved it meanwhile, in place or by a rename, is never overwritten. Refused (`MoespecError`, naming
    `path`) when it changed, and when it cannot be replaced (no permission, another user's file in a sticky
    folder, a full disk); the file is then as it was. Where the system can, the new file is swapped in and
    the old one checked after the swap, so that no moment is left between the check and the rename."""
    with output_lock(path):
        if not _holds(path, expected, before):
            raise _changed(path)
        try:
            with atomic.temp_output(path) as tmp:
                with open(tmp, "wb") as out:
                    out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
                os.chmod(tmp, before.st_mode & 0o7777)
                if atomic._exchange(tmp, path):
                    if not _holds(tmp, expected, before):  # an edit landed just before the swap: put it back
                        atomic._exchange(tmp, path)
                        raise _changed(path)
                elif _holds(path, expected, before):
                    os.replace(tmp, path)
                else:
                    raise _changed(path)
        except OSError as err:
            why = "no space left on the device" if err.errno == errno.ENOSPC else err.strerror or str(err)
            raise MoespecError(f"{path}: cannot replace it ({why}); it is as it was") from None


def _holds(path: Path, expected: bytes, before: os.stat_result) -> bool:
    """Whether `path` is still the file `before` describes (device and inode) and holds `expected`."""
    try:
        now = os.stat(path)
        with open(path, "rb") as file:
            return os.path.samestat(now, before) and file.read(len(expected) + 1) == expected
    except OSError:
        return False


def _changed(path: Path) -> MoespecError:
    return MoespecError(f"{path}: changed while it was being rewritten (saved by an editor?); it was left as it "
                        f"is now. Run the command again")

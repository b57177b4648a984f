"""Reading the files moespec did not just write (state JSON, cache entries, lock files): as plain files only,
bounded in size and in JSON nesting. A fifo is never opened to wait on it, a device never read to its end, a
symbolic link never followed, and a file over its cap is refused before it is read.

    read_regular(path, limit)      the bytes of a plain file of at most `limit` bytes, else `RefusedFile`
    load_json(data, max_depth)     JSON nested at most `max_depth` deep, else ValueError
    planted_kind(mode)             what a name that is not a plain file is, in words
    hub_target(path)               the plain file a name in a Hub folder leads to: itself, or a link of Hugging
                                   Face's cache into its own repository folder, else `RefusedFile`
"""

from __future__ import annotations

import itertools
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

MAX_JSON_DEPTH = 64
"""How deep the JSON files moespec reads may nest: theirs are a few levels deep; Python's parser fails near 1,000."""
_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class RefusedFile(Exception):
    """A file that is not read: not a plain file, over its size cap, or not there. The message says which."""


def planted_kind(mode: int) -> str:
    """What a name that is not a plain file is, in words ("a symbolic link", "a fifo", ...)."""
    kinds = [(stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a fifo"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")]
    return next((words for test, words in kinds if test(mode)), "not a plain file")


def read_regular(path: str | Path, limit: int, *, own: bool = False) -> bytes:
    """The bytes of the plain file `path`, at most `limit` of them. A symbolic link, fifo, socket, device or
    folder at `path`, a file larger than `limit` (or one that grows past it while it is read) and a file that
    cannot be opened raise `RefusedFile`; a fifo is opened without waiting for a writer, and nothing is read.
    With `own`, so does a file that is not this user's or that others may write."""
    try:
        fd = os.open(path, _FLAGS)
    except OSError as err:
        if os.path.islink(path):
            raise RefusedFile("a symbolic link; it is read only as a plain file") from None
        raise RefusedFile(err.strerror or str(err)) from None
    with os.fdopen(fd, "rb") as file:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise RefusedFile(f"{planted_kind(status.st_mode)}, not a plain file; not read")
        if own and (status.st_uid != _this_user() or status.st_mode & 0o022):
            raise RefusedFile("another user's file, or one that others may write; not trusted")
        if status.st_size > limit:
            raise RefusedFile(f"{status.st_size} bytes, over the {limit} it can be; not read")
        data = file.read(limit + 1)
    if len(data) > limit:
        raise RefusedFile(f"grew past {limit} bytes while it was read; not read")
    return data


HUB_CACHE_FOLDERS = ("snapshots", "blobs")
"""Hugging Face's cache keeps a repository as REPO/snapshots/REVISION/NAME, each NAME a link to REPO/blobs/HASH
(`huggingface_hub.hf_hub_download`)."""


def hub_cache_repo(folder: str | Path) -> Path | None:
    """The repository folder of Hugging Face's cache that `folder` is a snapshot of (REPO, for a `folder` that is
    REPO/snapshots/REVISION beside REPO/blobs), else None: an ordinary folder."""
    real = Path(os.path.realpath(folder))
    repo = real.parent.parent
    if real.parent.name != "snapshots" or not (repo / "blobs").is_dir() or os.path.islink(repo / "blobs"):
        return None
    return repo


def hub_target(path: str | Path) -> Path:
    """The plain file to read for the name `path` in a Hub folder: `path` itself where it is one, or the target of
    a link in a snapshot of Hugging Face's cache (`hub_cache_repo`) that resolves, link by link, to a plain file
    inside that repository's own folder. Any other link (in an ordinary folder, or out of the repository, or one
    that loops or leads nowhere), a fifo, socket, device or folder and a missing name raise `RefusedFile`, saying
    which; nothing is opened. Read the returned path with `read_regular`."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise RefusedFile("missing") from None
    except OSError as err:
        raise RefusedFile(err.strerror or str(err)) from None
    if not stat.S_ISLNK(mode):
        if not stat.S_ISREG(mode):
            raise RefusedFile(f"{planted_kind(mode)}, not a plain file; not read")
        return path
    repo = hub_cache_repo(path.parent)
    if repo is None:
        raise RefusedFile("a symbolic link; it is read only as a plain file (links are followed only in a snapshot "
                          "folder of Hugging Face's cache, REPO/snapshots/REVISION)")
    try:
        target = Path(os.path.realpath(path, strict=True))
    except OSError:
        raise RefusedFile("a symbolic link that loops or leads nowhere; not read") from None
    if not target.is_relative_to(repo):
        raise RefusedFile(f"a symbolic link out of its Hugging Face cache repository ({repo.name}); it is followed "
                          f"only to a file inside that repository's folder")
    target_mode = os.stat(target).st_mode
    if not stat.S_ISREG(target_mode):
        raise RefusedFile(f"a symbolic link to {planted_kind(target_mode)}, not to a plain file; not read")
    return target


def _this_user() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else -1


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


def json_depth(data: bytes) -> int:
    """How deep the arrays and objects of the JSON text `data` nest (brackets inside strings do not count)."""
    steps = (1 if b in b"[{" else -1 for b in _BRACKET.findall(_STRING.sub(b"", data)))
    return max(itertools.accumulate(steps, initial=0))


def load_json(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON text `data`, refused (ValueError) when it nests deeper than `max_depth`."""
    depth = json_depth(data)
    if depth > max_depth:
        raise ValueError(f"nested {depth} deep, over the {max_depth} it can be")
    return json.loads(data)

"""Names planted where a writer works (issue 47): the lock file's name and the leftover names. A writer never
follows, writes, truncates or removes what it did not make; it names what is there in one error, or steps
around it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from moespec.errors import MoespecError
from moespec.io import TensorInfo, atomic_output, output_lock, write_sharded
from moespec.io.atomic import HOST_TAG, WRITER_MARK

INFOS = [TensorInfo(f"t{i}", (100,), torch.float32) for i in range(2)]


def _write(path: Path, force: bool = False) -> None:
    write_sharded(path, INFOS, lambda info: torch.ones(info.shape), {}, force=force)


def _plant(kind: str, lock: Path, victim: Path) -> None:
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "dangling symlink":
        lock.symlink_to(victim.with_name("nothing-here"))
    elif kind == "symlink to /dev/null":
        lock.symlink_to("/dev/null")
    elif kind == "fifo":
        os.mkfifo(lock)
    elif kind == "folder":
        lock.mkdir()
        (lock / "notes.txt").write_text("a user's")
    elif kind == "hard link":
        os.link(victim, lock)
    elif kind == "other contents":
        lock.write_text("my notes, not a lock\n")


PLANTED = {"symlink": "a symbolic link", "dangling symlink": "a symbolic link",
           "symlink to /dev/null": "a symbolic link", "fifo": "a fifo", "folder": "a folder",
           "hard link": "a file with 2 names", "other contents": r"a file of 21 bytes that is not a lock"}


@pytest.mark.parametrize("kind", PLANTED)
@pytest.mark.parametrize("existing", [False, True], ids=["new", "over-an-output"])
def test_a_planted_lock_name_is_named_and_never_written(tmp_path, kind, existing):
    """A symlink at `.NAME.lock` made every writer truncate the linked file and write its pid into it; a fifo
    or /dev/null there was an internal error. Each is refused in one error that names it, and left as it is."""
    victim = tmp_path / "victim.txt"
    victim.write_text("another user's data\n")
    out = tmp_path / "out.safetensors"
    if existing:
        _write(out)
    before = out.read_bytes() if existing else None
    lock = tmp_path / ".out.safetensors.lock"
    _plant(kind, lock, victim)
    expected = rf"\.out\.safetensors\.lock: {PLANTED[kind]}.*moespec did not make"
    with pytest.raises(MoespecError, match=expected) as error:
        _write(out, force=True)
    assert "\n" not in str(error.value)
    assert victim.read_text() == "another user's data\n"
    assert os.path.lexists(lock)
    assert (out.read_bytes() if existing else None) == before
    if kind == "folder":
        assert (lock / "notes.txt").read_text() == "a user's"


def test_a_killed_writers_empty_or_whole_lock_file_is_taken_over(tmp_path):
    """What a killed writer leaves at the lock's name, an empty file or one naming it, is still taken over."""
    out = tmp_path / "out.safetensors"
    lock = tmp_path / ".out.safetensors.lock"
    lock.write_text("")
    _write(out)
    lock.write_text(json.dumps({"pid": 4242, "host": "elsewhere"}))
    _write(out, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors"]


def test_a_lock_name_planted_while_waiting_is_not_followed(tmp_path):
    """The lock is never the file a symlink points at, even when the link replaces the lock file of a writer
    that has just finished."""
    victim = tmp_path / "victim.txt"
    victim.write_text("data")
    out = tmp_path / "out.safetensors"
    with output_lock(out):
        lock = tmp_path / ".out.safetensors.lock"
        os.unlink(lock)
        lock.symlink_to(victim)
    assert victim.read_text() == "data"
    assert lock.is_symlink()  # the writer removed no name it did not make


@pytest.mark.parametrize("pid", ["4294967296", "0", "99999999999999999999999", str(2**22 + 1)])
def test_leftover_names_with_impossible_pids_are_not_ours(tmp_path, pid):
    """A leftover name with pid 4294967296 made every later write fail with OverflowError. A name whose pid no
    process of its host can have is not a writer's: it is left alone, and writes go on."""
    out = tmp_path / "out.safetensors"
    planted = [tmp_path / f".out.safetensors.{pid}@{HOST_TAG}.abcdefgh.tmp",
               tmp_path / f".out.safetensors.{pid}.abcdefgh.tmp"]
    for file in planted:
        file.write_text("a user's")
    folder = tmp_path / f".rep.old-{pid}@{HOST_TAG}"
    folder.mkdir()
    (folder / "notes.txt").write_text("a user's")
    folder.with_name(folder.name + WRITER_MARK).write_text("")
    _write(out)
    _write(out, force=True)
    with atomic_output(tmp_path / "rep", folder=True) as tmp:
        (tmp / "index.html").write_text("report")
    assert all(file.read_text() == "a user's" for file in planted)
    assert (folder / "notes.txt").read_text() == "a user's"
    assert (tmp_path / "rep" / "index.html").read_text() == "report"


def test_a_report_path_that_is_a_link_to_a_folder_is_refused(tmp_path):
    """`inspect -o` onto a symlink to a folder was an internal error and left a hidden link forever."""
    from moespec.io import check_output

    folder = tmp_path / "reports"
    folder.mkdir()
    (folder / "notes.txt").write_text("a user's")
    link = tmp_path / "rep"
    link.symlink_to(folder)
    for force in (False, True):
        with pytest.raises(MoespecError, match=r"rep is a symbolic link \(to .*reports\); a report folder is written"):
            check_output(link, force, folder=True)
        with pytest.raises(MoespecError, match="is a symbolic link"):
            with atomic_output(link, force=force, folder=True) as tmp:
                (tmp / "index.html").write_text("report")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep", "reports"]
    assert link.is_symlink() and [p.name for p in folder.iterdir()] == ["notes.txt"]

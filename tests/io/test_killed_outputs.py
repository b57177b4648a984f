"""Writers killed at every file-system step (issue 37): a report folder being replaced is the old or the new
report after the next ordinary command, which cleans up what the killed writer left; a checkpoint being
rewritten reads the same by its folder as by its path."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from moespec.errors import MoespecError
from moespec.io import atomic, atomic_output

from .test_write_ids import _read, _write

STEPS = ("replace", "rename", "link", "unlink", "remove", "rmdir")  # every change a writer makes to a folder


def _killed(step: int, work) -> bool:
    """Run `work` in a child process that SIGKILLs itself just before its `step`-th file-system change; False
    if it finished first."""
    pid = os.fork()
    if pid == 0:
        calls = [0]

        def dying(original):
            def call(*args, **kwargs):
                calls[0] += 1
                if calls[0] == step:
                    os.kill(os.getpid(), signal.SIGKILL)
                return original(*args, **kwargs)
            return call

        for name in STEPS:
            setattr(os, name, dying(getattr(os, name)))
        try:
            work()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status)


def _empty_folders(folder):
    """Step numbers 1, 2, ... with `folder` made empty before each: one kill point per round."""
    step = 0
    while True:
        step += 1
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        yield step


def _report(folder, text: str, force: bool = False) -> None:
    with atomic_output(folder, force=force, folder=True) as building:
        (building / "summary.json").write_text(text)
        (building / "index.html").write_text(text)


def _exchange_works(tmp_path) -> bool:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    works = atomic._exchange(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "a")
    shutil.rmtree(tmp_path / "b")
    return works


@pytest.mark.parametrize("swap", ["exchange", "two renames"])
def test_a_report_replacement_killed_at_any_step_is_recovered_by_the_next_ordinary_command(tmp_path, monkeypatch,
                                                                                           swap):
    """`inspect -o rep --force` killed between its renames left `.rep.old-PID` and no `rep`; the next
    `inspect -o rep` then exited 1 ("internal error: IsADirectoryError"). Now that command puts the old report
    back (and refuses to replace it without --force), or finds the new one, and removes what the kill left.
    Where the system swaps two names in one step (`exchange`), `rep` is the old or the new report at every
    moment, before any next command; elsewhere (`two renames`) the next command puts the old one back."""
    if swap == "exchange" and not _exchange_works(tmp_path):
        pytest.skip("this system or file system has no renameat2(RENAME_EXCHANGE)")
    if swap == "two renames":
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    rep, steps = tmp_path / "rep", 0
    while True:
        steps += 1
        for entry in tmp_path.iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        _report(rep, "old")
        if not _killed(steps, lambda: _report(rep, "new", force=True)):
            break
        if swap == "exchange":  # whole at the path, as the kill left it
            assert rep.is_dir(), f"killed at step {steps}: no report at the path"
            assert sorted(p.name for p in rep.iterdir()) == ["index.html", "summary.json"], f"killed at {steps}"
            assert (rep / "summary.json").read_text() in ("old", "new"), f"killed at step {steps}"
        with pytest.raises(MoespecError, match="already exists and is not empty; pass --force"):
            _report(rep, "next")  # the next ordinary command, without --force
        assert (rep / "summary.json").read_text() in ("old", "new"), f"killed at step {steps}"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"], f"killed at step {steps}"
        assert sorted(p.name for p in rep.iterdir()) == ["index.html", "summary.json"]
    assert steps > 2 and (rep / "summary.json").read_text() == "new"


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(1, 2), (2, 1), (2, 4)])
def test_a_killed_rewrite_reads_the_same_by_folder_as_by_path(tmp_path, before, after):
    """A one-file -> sharded rewrite killed early left a folder that `load(folder)` refused ("expected one
    checkpoint in this folder, found ...") while `load(path)` worked. Now both read the same checkpoint."""
    folder = tmp_path / "out"
    path = folder / "model.safetensors"
    for steps in _empty_folders(folder):
        _write(path, before, 1.0)
        if not _killed(steps, lambda: _write(path, after, 2.0)):
            break
        assert _read(path) in ({1.0}, {2.0}), f"killed at step {steps}"
        assert _read(folder) == _read(path), f"killed at step {steps}"
    assert steps > after + 1 and _read(folder) == {2.0}


@pytest.mark.parametrize("files", [1, 4])
def test_a_first_write_killed_at_any_step_is_cleaned_up_by_the_next_ordinary_write(tmp_path, files):
    """A checkpoint write to a new path killed at any step: the next write without --force goes ahead when no
    checkpoint is there (it was refused while the killed write's journal was there), removes what the killed
    write left, and leaves only the new checkpoint's files. Where the killed write got as far as its index,
    the checkpoint is there, and replacing it still takes --force."""
    folder = tmp_path / "out"
    path = folder / "model.safetensors"
    for steps in _empty_folders(folder):
        if not _killed(steps, lambda: _write(path, files, 1.0, force=False)):
            break
        complete = path.is_file() or path.with_name(path.name + ".index.json").is_file()
        if complete:
            with pytest.raises(MoespecError, match="already exists"):
                _write(path, files, 2.0, force=False)
        else:
            _write(path, files, 2.0, force=False)  # the next ordinary write
        assert _read(path) == ({1.0} if complete else {2.0}), f"killed at step {steps}"
        left = sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))
        assert all(not name.startswith(".") for name in left) or complete, f"killed at step {steps}: {left}"
    assert steps > files

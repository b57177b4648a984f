"""Leftovers are a writer's by pid and host (`io.atomic.owner_tag`): a killed writer's are removed by the next
write on its host, another host's never (a pid means nothing on another machine), and one that blocks a write
is named in the error. A folder already under the name a writer would move the old output to is never taken
over (issue 37)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import moespec.distributed as md
from moespec.errors import CheckpointError, MoespecError
from moespec.io import TensorInfo, atomic, write_sharded
from moespec.io.atomic import HOST_TAG, atomic_output, check_output

from ..conftest import TINY_VIT, make_spec

OTHER_HOST = "0badc0de" if HOST_TAG != "0badc0de" else "0badf00d"

LIVE_ELSEWHERE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import moespec.io.atomic as atomic
    atomic.HOST_TAG = sys.argv[2]  # a writer on another host that shares the folder
    with atomic.temp_output(Path(sys.argv[1])) as tmp:
        tmp.write_text("being written on another host")
        print(tmp.name, flush=True)
        time.sleep(60)
""")


def _write(path) -> None:
    write_sharded(path, [TensorInfo("t", (4,), torch.float32)], lambda info: torch.ones(4), {})


def test_another_hosts_temp_file_is_never_taken_for_a_killed_writers(tmp_path):
    """A writer on another host, whose pid does not run here (it is gone here: killed, as far as this host can
    tell): its temp file was named by pid alone and removed by this host's next write, mid-write. Now its name
    carries its host, and no write here removes it."""
    path = tmp_path / "out.safetensors"
    writer = subprocess.Popen([sys.executable, "-c", LIVE_ELSEWHERE, str(path), OTHER_HOST], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    name = writer.stdout.readline().strip()
    os.kill(writer.pid, signal.SIGKILL)  # its pid no longer runs here
    writer.wait(timeout=30)
    _write(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, "out.safetensors"])
    assert (tmp_path / name).read_text() == "being written on another host"
    assert name.startswith(f".out.safetensors.{writer.pid}@{OTHER_HOST}.")


def test_another_hosts_moved_aside_report_is_named_when_it_blocks_and_never_moved(tmp_path, monkeypatch):
    """A report folder that a writer on another host moved aside (marked as its own), with no report at the
    path: the next write is refused, naming it, rather than writing a new report beside the only copy of the
    old one; with a report at the path, writes go ahead and leave it alone."""
    report = tmp_path / "rep"
    aside = tmp_path / f".rep.old-{2**22 + 7}@{OTHER_HOST}"
    aside.mkdir()
    (aside / "summary.json").write_text("the old report")
    atomic._mark(aside).touch()
    with pytest.raises(MoespecError) as error:
        check_output(report, force=False, folder=True)
    message = str(error.value)
    assert message.startswith(f"{report}: not there, and {aside.name} beside it holds the folder that a moespec "
                              f"process on another host moved aside") and "\n" not in message, message
    report.mkdir()
    (report / "summary.json").write_text("a report")
    with atomic_output(report, force=True, folder=True) as tmp:
        (tmp / "summary.json").write_text("the new report")
    assert (report / "summary.json").read_text() == "the new report"
    assert (aside / "summary.json").read_text() == "the old report" and atomic._mark(aside).is_file()


def test_a_folder_under_this_writers_aside_name_is_never_taken_over(tmp_path):
    """A folder already at `.rep.old-{this pid}` (a user's; or one that a dead writer with the same pid left):
    the write moved the old report onto that name (a non-empty folder: an internal error, FileExistsError), after
    marking it as its own, so that a later write would have removed it. Now the old report goes to a name that
    nothing has."""
    report = tmp_path / "rep"
    report.mkdir()
    (report / "summary.json").write_text("the old report")
    taken = [tmp_path / f".rep.old-{os.getpid()}", tmp_path / f".rep.old-{atomic.owner_tag()}"]
    for folder in taken:
        folder.mkdir()
        (folder / "notes.txt").write_text("a user's")
    with atomic_output(report, force=True, folder=True) as tmp:
        (tmp / "summary.json").write_text("the new report")
    atomic.check_output(report, force=True, folder=True)
    assert (report / "summary.json").read_text() == "the new report"
    for folder in taken:
        assert (folder / "notes.txt").read_text() == "a user's" and not atomic._mark(folder).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["rep", *(p.name for p in taken)])


def _model():
    import moespec

    model = moespec.create_model(make_spec(TINY_VIT, [{"where": {"last": 1}, "experts": 2}]), seed=0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_a_state_folder_under_this_processs_aside_name_survives_a_save(tmp_path):
    """save_state moved the old state aside to `.state.old-{pid}`, and first removed a folder already there
    that held only state file names (taken for an earlier save's leftover). A planted one, or a dead save's
    with the same pid (the only copy of its state), was lost."""
    model, optimizer = _model()
    md.save_state(tmp_path / "state", model, optimizer, extra={"step": 1})
    planted = tmp_path / f".state.old-{os.getpid()}"
    planted.mkdir()
    (planted / "extra.json").write_text('{"step": 0}')
    md.save_state(tmp_path / "state", model, optimizer, extra={"step": 2})
    assert (planted / "extra.json").read_text() == '{"step": 0}'
    assert md.load_state(tmp_path / "state", model, optimizer) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["state", planted.name])


def test_another_hosts_moved_aside_state_is_named_when_it_blocks_and_never_moved(tmp_path):
    model, optimizer = _model()
    md.save_state(tmp_path / "state", model, optimizer, extra={"step": 1})
    aside = tmp_path / f".state.old-{2**22 + 7}@{OTHER_HOST}"
    (tmp_path / "state").rename(aside)  # another host's save_state, between its two renames
    with pytest.raises(CheckpointError, match=rf"state: not there, and {aside.name} beside it holds the training "
                                              rf"state that a save_state on another host moved aside"):
        md.load_state(tmp_path / "state", model, optimizer)
    with pytest.raises(CheckpointError, match=rf"rename {aside.name} back to state"):
        md.save_state(tmp_path / "state", model, optimizer, extra={"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == [aside.name]
    aside.rename(tmp_path / "state")
    assert md.load_state(tmp_path / "state", model, optimizer) == {"step": 1}

"""save_state / load_state against kills, planted files and states that do not fit: every failure is one
CheckpointError naming the folder, nothing in a folder runs code, and a save killed at any point leaves a
state that loads (old or new) and a folder the next save writes to. Kills run in `state_worker.py`, a
subprocess with a timeout."""

from __future__ import annotations

import builtins
import importlib.util
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

import moespec
import moespec.distributed as md
import moespec.distributed.state_reading as reading
from moespec.errors import CheckpointError

from .ep_cases import VIT
from .launch import ROOT

WORKER = ROOT / "tests" / "distributed" / "state_worker.py"


def _worker(tmp_path: Path, mode: str, *args: str, timeout: float, world: int = 1) -> object:
    command = [sys.executable, str(WORKER), mode, str(tmp_path), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STATE_WORLD": str(world)}
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        raise AssertionError(f"state_worker {mode} hung past {timeout} s:\n{expired.stderr}") from None
    assert done.returncode == 0, f"state_worker {mode} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return json.loads((tmp_path / f"{mode}.json").read_text())


def _spec(experts: int = 2, name: str = "two"):
    return moespec.load_spec({"name": name, "backbone": VIT, "input_size": [3, 32, 32],
                              "moe": [{"where": {"every": 1}, "experts": experts, "top_k": 1}]})


def _trained(spec):
    model = moespec.create_model(spec, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A state saved in one process (no torch.distributed), copied by each test before it alters it."""
    folder = tmp_path_factory.mktemp("saved") / "state"
    md.save_state(folder, *_trained(_spec()), extra={"step": 1})
    return folder


@pytest.fixture
def state(saved, tmp_path):
    copy = tmp_path / "state"
    copy.mkdir()
    for file in saved.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    return copy


def _load(folder: Path, spec=None) -> dict:
    model = moespec.create_model(spec or _spec(), seed=1)
    return md.load_state(folder, model, torch.optim.AdamW(model.parameters(), lr=1e-3))


class _Payload:
    """Unpickled, it creates the marker file: the code a planted pickle runs."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return builtins.open, (str(self.marker), "w")


@pytest.mark.slow  # 13 s: a subprocess per rename
def test_a_save_killed_at_each_rename_loads_old_or_new_and_the_next_save_works(tmp_path):
    points = _worker(tmp_path, "points", timeout=120)
    assert points["rename"] == 3, points  # DCP's .metadata, the old state moved aside, the new one moved in
    results = _worker(tmp_path, "kill", *(f"rename:{n}" for n in range(1, points["rename"] + 1)), timeout=240)
    for result in results:
        assert result["killed"] and not result["problems"], result


@pytest.mark.slow
def test_a_save_killed_at_every_line_loads_old_or_new_and_the_next_save_works(tmp_path):
    points = _worker(tmp_path, "points", timeout=120)
    results = _worker(tmp_path, "kill", *(f"line:{n}" for n in range(1, points["line"] + 2)), timeout=1200)
    assert points["line"] > 50
    assert [r["killed"] for r in results] == [True] * points["line"] + [False]  # every point, then a whole save
    for result in results:
        assert not result["problems"], result


@pytest.mark.slow
def test_a_save_sigkilled_at_random_times_loads_old_or_new_and_the_next_save_works(tmp_path):
    for result in _worker(tmp_path, "sigkill", "6", timeout=300):
        assert not result["problems"], result


@pytest.mark.slow
def test_a_two_rank_save_killed_at_each_rename_or_on_either_rank_loads_old_or_new_at_two_ranks(tmp_path):
    """At world size 2 (experts sharded over the ranks): a save killed just after each of rank 0's renames, or
    at lines spread over each rank's save (the other rank SIGKILLed with it, as torchrun does), leaves a
    state that two ranks load whole, old or new, and the next two-rank save works."""
    points = _worker(tmp_path, "points", timeout=120, world=2)
    assert points["rename"] == 3 and [r["rename"] for r in points["ranks"]] == [3, 0], points
    lines = [f"{rank}:line:{n * counts['line'] // 5}" for rank, counts in enumerate(points["ranks"])
             for n in range(1, 5)]
    kills = [f"rename:{n}" for n in range(1, 4)] + lines
    results = _worker(tmp_path, "kill", *kills, timeout=600, world=2)
    assert [r["point"] for r in results] == kills
    for result in results:
        assert result["killed"] and not result["problems"], result


@pytest.mark.slow
def test_a_two_rank_save_sigkilled_at_random_times_loads_old_or_new_at_two_ranks(tmp_path):
    """At world size 2: both ranks save over and over, and are SIGKILLed at a random time, one rank first
    (the other a moment later) or both at once; two ranks then load the last complete save or the one being
    written, whole, and save again."""
    results = _worker(tmp_path, "sigkill", "6", timeout=400, world=2)
    assert len(results) == 6
    for result in results:
        assert not result["problems"], result


def test_a_save_that_fails_is_one_error_and_leaves_the_old_state_and_nothing_else(state, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", disk_full)
    with pytest.raises(CheckpointError, match=r"state: cannot save the training state: no space left on the device; "
                                              r"the previous state is unchanged"):
        md.save_state(state, *_trained(_spec()), extra={"step": 2})
    monkeypatch.undo()
    assert _load(state) == {"step": 1}
    assert [p.name for p in state.parent.iterdir()] == ["state"]


def test_a_planted_metadata_pickle_runs_nothing(state, tmp_path):
    marker = tmp_path / "ran"
    (state / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata: not DCP metadata .*refused to build io\.open.*nothing "
                                              r"in it was run"):
        _load(state)
    assert not marker.exists()


def test_a_planted_optimizer_value_runs_nothing(tmp_path):
    """The non-tensor items (optimizer hyperparameters) are pickles inside the .distcp files."""
    marker = tmp_path / "ran"
    model, optimizer = _trained(_spec())
    optimizer.param_groups[0]["lr"] = _Payload(marker)
    md.save_state(tmp_path / "state", model, optimizer)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=r"refused to unpickle the saved optim\.param_groups\..*lr"):
        _load(tmp_path / "state")
    assert not marker.exists()


def test_metadata_pointing_outside_its_folder_is_refused(state, tmp_path):
    metadata = pickle.loads((state / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    (state / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"__RANK_N\.distcp files of its own folder"):
        _load(state)


def test_metadata_larger_than_its_data_is_refused_unread(state, monkeypatch):
    data = (state / "__0_0.distcp").stat().st_size
    with open(state / ".metadata", "r+b") as f:
        f.truncate(data + reading.METADATA_SLACK_BYTES + 1)  # sparse: no real bytes written
    monkeypatch.setattr(reading._MetadataUnpickler, "load", lambda self: pytest.fail("the metadata was read"))
    with pytest.raises(CheckpointError, match=rf"bytes of DCP metadata for {data} bytes of data.*not read"):
        _load(state)


def test_a_huge_extra_json_is_refused_unread(state):
    with open(state / "extra.json", "r+b") as f:
        f.truncate(reading.MAX_JSON_BYTES + 1)
    with pytest.raises(CheckpointError, match=r"extra\.json: \d+ bytes, over the .*not read"):
        _load(state)


def test_a_truncated_distcp_is_one_checkpoint_error_naming_it(state):
    data = state / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"^{data}: cut short at \d+ bytes; the training state's \.metadata "
                                              r"places data up to byte \d+$"):
        _load(state)


def test_a_missing_distcp_is_one_checkpoint_error_naming_it(state):
    (state / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: missing; the training state's \.metadata points"):
        _load(state)


def test_a_corrupt_distcp_is_one_checkpoint_error(state):
    data = state / "__0_0.distcp"
    data.write_bytes(bytes(data.stat().st_size))  # as long as it was, all zeros
    with pytest.raises(CheckpointError) as error:
        _load(state)
    message = str(error.value)
    assert message.startswith(f"{state}: cannot read the training state (") and "\n" not in message, message
    assert message.endswith("is the folder complete, as save_state wrote it?") and len(message) < 400, message


def test_a_state_of_another_spec_names_both_specs_and_the_first_tensor(state):
    with pytest.raises(CheckpointError) as error:
        _load(state, _spec(4, "four"))
    message = str(error.value)
    assert message.startswith(f"{state}: saved with spec 'two' (sha256 "), message
    assert "this model is spec 'four' (sha256 " in message, message
    assert "model.blocks.0.mlp.router.gate.weight is [2, 32] there, [4, 32] here" in message, message
    assert message.endswith("resume with the spec it was saved with") and "\n" not in message, message


def test_a_state_saved_before_spec_json_still_loads_and_still_says_what_does_not_fit(state):
    (state / "spec.json").unlink(missing_ok=True)  # as save_state wrote it before spec.json
    assert _load(state) == {"step": 1}
    with pytest.raises(CheckpointError, match=r"saved for another model or optimizer: model\.blocks\.0\.mlp\.router"
                                              r"\.gate\.weight is \[2, 32\] there, \[4, 32\] here"):
        _load(state, _spec(4, "four"))


def test_a_state_missing_entries_names_the_first_and_counts_the_rest(state):
    spec = moespec.load_spec({"name": "two", "backbone": VIT, "input_size": [3, 32, 32],
                              "moe": [{"where": {"every": 2}, "experts": 2, "top_k": 1}]})  # block 0 stays dense
    with pytest.raises(CheckpointError, match=r"it has no model\.blocks\.0\.mlp\.fc1\.\w+ \(and \d+ more\)"):
        _load(state, spec)


def _train_script():
    spec = importlib.util.spec_from_file_location("moespec_train_tool", ROOT / "tools" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_resume_with_another_spec_says_which_spec_the_state_was_saved_with(tmp_path, capsys):
    train = _train_script()
    ep_tiny = ROOT / "tests" / "data" / "ep_tiny.yaml"
    other = tmp_path / "other.yaml"
    other.write_text(ep_tiny.read_text().replace("name: ep-tiny", "name: ep-tiny-8").replace("experts: 4",
                                                                                            "experts: 8"))
    run = ["--steps", "1", "--batch-size", "2", "--synthetic-size", "4", "--log-every", "1"]
    train.main([str(ep_tiny), *run, "--output", str(tmp_path / "run")])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        train.main([str(other), *run, "--resume", str(tmp_path / "run")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("train.py: error: ") and "\n" not in err, err
    assert "saved with spec 'ep-tiny' (sha256" in err and "this model is spec 'ep-tiny-8'" in err, err


def test_train_resume_from_a_state_without_its_step_and_schedule_says_so(tmp_path, capsys):
    train, spec = _train_script(), str(ROOT / "tests" / "data" / "ep_tiny.yaml")
    run = ["--steps", "2", "--batch-size", "2", "--synthetic-size", "4"]
    train.main([spec, *run, "--save-every", "1", "--output", str(tmp_path / "run")])
    (tmp_path / "run" / "state" / "extra.json").write_text('{"step": 1}')  # as md.save_state(..., extra=...) saves
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        train.main([spec, *run, "--resume", str(tmp_path / "run")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"train.py: error: {tmp_path / 'run' / 'state'}: not a state that tools/train.py saved (its "
                   f"extra.json has no step and scheduler); resume from an --output folder of this script"), err

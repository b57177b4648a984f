"""What save_state may replace and what load_state reads (issue 47): a folder is replaced only when it is a
state that save_state wrote (its mark), or with force=True; a link is followed only to a state folder; a full
disk is said plainly; the state's files are read as plain files, bounded in size and depth, never a fifo or a
device."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

import moespec
import moespec.distributed as md
from moespec.errors import CheckpointError
from moespec.io.lock import output_lock

from .ep_cases import VIT


@pytest.fixture(scope="module")
def trained():
    spec = moespec.load_spec({"name": "two", "backbone": VIT, "input_size": [3, 32, 32],
                              "moe": [{"where": {"every": 1}, "experts": 2, "top_k": 1}]})
    model = moespec.create_model(spec, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    return model, optimizer


def _load(folder: Path, trained) -> dict:
    return md.load_state(folder, *trained)


def _users_folder(folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {"notes.txt": "my notes", "extra.json": '{"mine": true}'}
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


def test_a_folder_that_is_not_a_state_is_refused_without_force(tmp_path, trained):
    """save_state deleted whatever folder was at its path."""
    folder = tmp_path / "results"
    files = _users_folder(folder)
    with pytest.raises(CheckpointError, match=r"results: a folder that is not a training state .*moespec_state\.json"
                                              r".*pass force=True"):
        md.save_state(folder, *trained, extra={"step": 1})
    assert {p.name: p.read_text() for p in folder.iterdir()} == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]
    md.save_state(folder, *trained, extra={"step": 2}, force=True)
    assert _load(folder, trained) == {"step": 2}


def test_the_working_folder_is_never_replaced(tmp_path, trained, monkeypatch):
    """`save_state(os.getcwd() + "/")` removed the working folder's files."""
    files = _users_folder(tmp_path / "work")
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(CheckpointError, match="a folder that is not a training state"):
        md.save_state(os.getcwd() + "/", *trained)
    assert {p.name: p.read_text() for p in Path.cwd().iterdir()} == files


def test_a_state_is_replaced_and_so_is_an_empty_folder_or_a_state_from_before_the_mark(tmp_path, trained):
    folder = tmp_path / "state"
    folder.mkdir()
    md.save_state(folder, *trained, extra={"step": 1})
    assert (folder / "moespec_state.json").is_file()
    md.save_state(folder, *trained, extra={"step": 2})
    assert _load(folder, trained) == {"step": 2}
    (folder / "moespec_state.json").unlink()  # as save_state wrote it before the mark
    md.save_state(folder, *trained, extra={"step": 3})
    assert _load(folder, trained) == {"step": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_a_save_waits_for_another_writer_of_the_same_path(tmp_path, trained, monkeypatch):
    """Two saves to one new path at once: the second found nothing at `path`, the first then renamed its folder
    there, and the second's rename failed "Directory not empty" (the fuzzer, tools/fuzz_writes.py, found it).
    A save swaps its folder in under the output's lock, and checks `path` again under it."""
    folder = tmp_path / "state"
    md.save_state(tmp_path / "first", *trained, extra={"step": 1})  # the first writer's complete folder
    written, go, done = threading.Event(), threading.Event(), threading.Event()
    real_save = md.state.dcp.save

    def save_then_wait(*args, **kwargs):  # the second writer, its files written, before its swap
        real_save(*args, **kwargs)
        written.set()
        go.wait(60)

    monkeypatch.setattr(md.state.dcp, "save", save_then_wait)

    def second_save():
        md.save_state(folder, *trained, extra={"step": 2})
        done.set()

    second = threading.Thread(target=second_save)
    second.start()
    assert written.wait(60)
    with output_lock(folder):  # the first writer, between its check of `path` and its rename
        go.set()
        assert not done.wait(1.0), "the second save renamed its folder while the first held the output's lock"
        os.replace(tmp_path / "first", folder)
    second.join(60)
    assert done.is_set()
    assert _load(folder, trained) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_a_file_at_the_path_is_named_and_kept(tmp_path, trained):
    """save_state onto a file said "the report is a folder"."""
    file = tmp_path / "state"
    file.write_text("a user's file")
    for force in (False, True):
        with pytest.raises(CheckpointError, match=r"state is a file; a training state is a folder"):
            md.save_state(file, *trained, force=force)
    assert file.read_text() == "a user's file"


def test_a_link_is_followed_only_to_a_state_folder(tmp_path, trained):
    """Through a symlinked folder save_state said "Is a directory"; a link to a state now saves there."""
    real = tmp_path / "real"
    md.save_state(real, *trained, extra={"step": 1})
    link = tmp_path / "link"
    link.symlink_to(real)
    md.save_state(link, *trained, extra={"step": 2})
    assert link.is_symlink() and _load(real, trained) == {"step": 2}
    other = tmp_path / "other"
    files = _users_folder(other)
    (tmp_path / "to-other").symlink_to(other)
    for force in (False, True):
        with pytest.raises(CheckpointError, match=r"to-other: a symbolic link to .*other, which is a folder that is "
                                                  r"not a training state; save_state follows a link only"):
            md.save_state(tmp_path / "to-other", *trained, force=force)
    assert {p.name: p.read_text() for p in other.iterdir()} == files


def test_a_full_disk_in_torchs_writer_is_said_plainly(tmp_path, trained, monkeypatch):
    """A full disk during the save said "enforce fail at inline_container.cc"."""
    md.save_state(tmp_path / "state", *trained, extra={"step": 1})

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    with pytest.raises(CheckpointError, match=r"state: cannot save the training state: no space left on the device; "
                                              r"the previous state is unchanged$"):
        md.save_state(tmp_path / "state", *trained, extra={"step": 2})
    monkeypatch.undo()
    assert _load(tmp_path / "state", trained) == {"step": 1}


def test_a_full_disk_while_writing_extra_json_is_one_checkpoint_error(tmp_path, trained, monkeypatch):
    write_text = Path.write_text

    def full(self, *args, **kwargs):
        if self.name == "extra.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(CheckpointError, match=r"no space left on the device\); the previous state is unchanged"):
        md.save_state(tmp_path / "state", *trained)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["spec.json", "extra.json", ".metadata"])
@pytest.mark.parametrize("planted", ["fifo", "link to /dev/zero"])
def test_state_files_are_read_only_as_plain_files(tmp_path, trained, no_hang, name, planted):
    """load_state blocked forever on a fifo at spec.json, and read /dev/zero until memory ran out."""
    folder = tmp_path / "state"
    md.save_state(folder, *trained, extra={"step": 1})
    (folder / name).unlink()
    if planted == "fifo":
        os.mkfifo(folder / name)
    else:
        (folder / name).symlink_to("/dev/zero")
    kind = "a fifo, not a plain file" if planted == "fifo" else "a symbolic link"
    with pytest.raises(CheckpointError, match=rf"{name}: {kind}"):
        _load(folder, trained)


def test_a_deeply_nested_extra_json_is_one_checkpoint_error(tmp_path, trained):
    """A deeply nested extra.json was an internal error (RecursionError)."""
    folder = tmp_path / "state"
    md.save_state(folder, *trained, extra={"step": 1})
    (folder / "extra.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=r"extra\.json: not the JSON save_state writes \(nested 100000 deep, "
                                              r"over the 64"):
        _load(folder, trained)


def test_a_state_with_a_nan_balancing_bias_is_refused_and_the_models_buffers_left_as_they_were(tmp_path):
    spec = moespec.load_spec({"name": "b", "backbone": VIT, "input_size": [3, 32, 32], "moe": [
        {"where": {"every": 1}, "experts": 2, "router": {"kind": "topk", "top_k": 1, "bias_balance": {}}}]})
    model = moespec.create_model(spec, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bias = "blocks.0.mlp.router.balance.expert_bias"
    model.get_buffer(bias)[0] = float("nan")
    md.save_state(tmp_path / "state", model, optimizer)
    fresh = moespec.create_model(spec, seed=0)
    with pytest.raises(CheckpointError, match=rf"state: {bias} holds nan"):
        md.load_state(tmp_path / "state", fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    assert torch.equal(fresh.get_buffer(bias), torch.zeros(2))

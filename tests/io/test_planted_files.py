"""Files planted next to an output or named by an index (issue 37): a journal or an index is not trusted
input. A write removes only files it can prove are the output's; oversized indexes and journals are refused
unread (memory measured); an index is read in time linear in its shards, and its errors stay short and say
what a shard that is not a file is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moespec.errors import CheckpointError, MoespecError
from moespec.io import TensorInfo, checkpoint_files, sharding, write_safetensors, write_sharded
from moespec.io.write_ids import write_id_of

INFOS = [TensorInfo(f"t{i}", (100,), torch.float32) for i in range(4)]  # 400 bytes each


def _write(path, force=False, max_shard_size=10**9):
    return write_sharded(path, INFOS, lambda info: torch.ones(info.shape), {}, max_shard_size=max_shard_size,
                         force=force)


def _bystanders(folder: Path) -> dict[str, bytes]:
    """Two checkpoints that are not the output: a dense one without a write id, and another moespec output."""
    save_file({"w": torch.zeros(3)}, str(folder / "dense.safetensors"))
    _write(folder / "other.safetensors")
    return {name: (folder / name).read_bytes() for name in ("dense.safetensors", "other.safetensors")}


def test_a_planted_journal_removes_nothing_it_names(tmp_path):
    """A journal `.out.safetensors.write.json` naming a dense checkpoint (no write id) and another moespec
    output (with its write id) in the same folder: the forced write once deleted both."""
    kept = _bystanders(tmp_path)
    (tmp_path / ".out.safetensors.write.json").write_text(json.dumps({
        "write_ids": [None, write_id_of(tmp_path / "other.safetensors")],
        "names": ["dense.safetensors", "other.safetensors", "out.safetensors"]}))
    out = tmp_path / "out.safetensors"
    _write(out)  # no checkpoint is there: an ordinary write goes ahead (issue 37), and removes nothing named
    assert {name: (tmp_path / name).read_bytes() for name in kept} == kept
    _write(out, force=True, max_shard_size=400)
    assert {name: (tmp_path / name).read_bytes() for name in kept} == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*kept, "out.safetensors.index.json", *(f"out-0000{i}-of-00004.safetensors" for i in range(1, 5))])


def test_a_planted_index_removes_nothing_but_its_own_shards(tmp_path):
    """An index at the output's index path whose weight_map names files that are not the output's shards:
    `--force` replaces the output, and those files stay."""
    kept = _bystanders(tmp_path)
    (tmp_path / "out.safetensors.index.json").write_text(json.dumps({
        "metadata": {}, "weight_map": {"w": "dense.safetensors", "t0": "other.safetensors"}}))
    _write(tmp_path / "out.safetensors", force=True)
    assert {name: (tmp_path / name).read_bytes() for name in kept} == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, "out.safetensors"])


RSS = textwrap.dedent("""
    import json, resource, sys, torch
    from moespec.errors import MoespecError
    from moespec.io import TensorInfo, write_sharded
    infos = [TensorInfo("t", (10,), torch.float32)]
    results = []
    for output in sys.argv[1:]:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            write_sharded(output, infos, lambda info: torch.ones(10), {}, force=True)
            error = None
        except MoespecError as err:
            error = str(err)
        results.append({"grown_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, "error": error})
    print(json.dumps(results))
""")


@pytest.mark.slow
def test_a_huge_index_or_journal_is_refused_unread(tmp_path):
    """A 1 GB junk file (sparse: no disk used) where the writer looks for the output's index or journal: it
    once read it whole (2.8 GB peak RSS). Refused unread, even with --force; the peak RSS of the writing
    process barely moves."""
    planted = [tmp_path / "a" / ".out.safetensors.write.json", tmp_path / "b" / "out.safetensors.index.json"]
    for junk in planted:
        junk.parent.mkdir()
        with open(junk, "wb") as f:
            f.truncate(10**9)
    run = subprocess.run([sys.executable, "-c", RSS, *(str(junk.parent / "out.safetensors") for junk in planted)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for junk, result in zip(planted, json.loads(run.stdout), strict=True):
        assert result["grown_kib"] < 100 * 1024, result
        assert result["error"] is not None and f"{junk}: 1,000,000,000 bytes, more than" in result["error"], result
        assert len(result["error"]) < 300
        assert [p.name for p in junk.parent.iterdir()] == [junk.name]


def _index(folder: Path, weight_map: dict[str, str]) -> Path:
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def test_an_index_naming_10000_missing_shards_gives_a_short_error(tmp_path):
    """100,000 missing shards once gave a 3.6 MB message."""
    index = _index(tmp_path, {f"t{i}": f"model-{i:05d}-of-10000.safetensors" for i in range(10_000)})
    with pytest.raises(CheckpointError) as caught:
        checkpoint_files(index)
    message = str(caught.value)
    assert len(message) < 300 + len(str(index)), message[:1000]
    assert "shard(s) missing next to it: model-00000-of-10000.safetensors" in message
    assert "and 9997 more (10000 of 10000)" in message


def test_shards_that_are_not_files_say_what_they_are(tmp_path):
    (tmp_path / "model-00001-of-00004.safetensors").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "model-00002-of-00004.safetensors")
    (tmp_path / "model-00003-of-00004.safetensors").mkdir()
    index = _index(tmp_path, {f"t{i}": f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)})
    with pytest.raises(CheckpointError, match=r"shard\(s\) missing or not files next to it: "
                                              r"model-00001-of-00004.safetensors \(a device, not a file\), "
                                              r"model-00002-of-00004.safetensors \(a fifo, not a file\), "
                                              r"model-00003-of-00004.safetensors \(a folder, not a file\) "
                                              r"and 1 more \(4 of 4\)"):
        checkpoint_files(index)
    os.mkfifo(tmp_path / "one.safetensors")
    with pytest.raises(CheckpointError, match=r"one.safetensors: not a checkpoint file \(a fifo\)"):
        checkpoint_files(tmp_path / "one.safetensors")


@pytest.mark.parametrize("content", [{"metadata": {}, "weight_map": {}}, ["not", "an", "index"], "junk"])
def test_a_junk_index_is_called_what_it_is(tmp_path, content):
    """A junk file at the output's index path was called "a sharded checkpoint (... 0 shard(s))"."""
    index = tmp_path / "out.safetensors.index.json"
    index.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(MoespecError, match=f"^{index} already exists and is not a safetensors index; pass --force"):
        _write(tmp_path / "out.safetensors")
    with pytest.raises(CheckpointError, match="names no shard|not a safetensors index|not a readable safetensors"):
        checkpoint_files(index)


def test_another_users_stale_temp_file_is_left_alone(tmp_path, monkeypatch):
    """A dead writer's temp file that this user may not remove (another user's, in a sticky folder) gave
    "internal error: PermissionError". It is skipped."""
    theirs = tmp_path / ".out.safetensors.999999999.abcdefgh.tmp"  # no such pid
    theirs.write_bytes(b"someone else's")
    unlink = Path.unlink

    def sticky(self, missing_ok=False):
        if self.name == theirs.name:
            raise PermissionError(1, "Operation not permitted", str(self))
        return unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", sticky)
    _write(tmp_path / "out.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == [theirs.name, "out.safetensors"]


@pytest.mark.slow
def test_reading_an_index_is_linear_in_its_shards(tmp_path, monkeypatch):
    """An index of N one-tensor shards took 3.4 s at 3,000 and 11.5 s at 6,000 (quadratic: about 2.5 min at
    20,000). 20,000 are now read with one header read per shard; the time is `tools/bench_index.py`'s to
    measure, not a test's: a wall-clock bound fails on a busy machine."""
    shapes = sharding.safetensors_shapes
    shards = 20_000
    weight_map = {}
    for i in range(shards):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        write_safetensors(tmp_path / name, [TensorInfo(f"t{i}", (1,), torch.float32)],
                          lambda info: torch.ones(1), {})
        weight_map[f"t{i}"] = name
    index = _index(tmp_path, weight_map)
    reads = []  # each shard's header read once: a bound on work (tools/bench_index.py times it)
    monkeypatch.setattr(sharding, "safetensors_shapes", lambda file: reads.append(file) or shapes(file))
    _, files = checkpoint_files(index)
    assert len(files) == shards and len(reads) == shards and len(set(reads)) == shards


def test_folders_with_a_writers_names_but_not_its_mark_are_never_moved_or_removed(tmp_path):
    """A report (any folder output) removes or puts back only folders it can tie to a writer: a dead writer's
    temp folder or moved-aside old report carries a mark beside it (`atomic._mark`). Folders planted under the
    same names, holding a user's files, survive a forced replacement and the next ordinary check."""
    from moespec.io import atomic

    dead = subprocess.Popen(["true"])
    dead.wait()
    report = tmp_path / "rep"
    report.mkdir()
    (report / "old.txt").write_text("the old report")
    planted = [tmp_path / f".rep.old-{dead.pid}", tmp_path / f".rep.{dead.pid}.abcdefgh.tmp"]
    for folder in planted:
        folder.mkdir()
        (folder / "notes.txt").write_text("a user's")
    with atomic.atomic_output(report, force=True, folder=True) as tmp:
        (tmp / "new.txt").write_text("the new report")
    atomic.check_output(report, force=True, folder=True)
    assert sorted(p.name for p in report.iterdir()) == ["new.txt"]
    for folder in planted:
        assert (folder / "notes.txt").read_text() == "a user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["rep", *(p.name for p in planted)])

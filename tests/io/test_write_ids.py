"""A sharded commit is all or nothing as a reader sees it: killed at any step, the old checkpoint or the new one
reads back, never a mix, and the next forced write removes whatever the kill left; shards of different writes
are refused."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch

from moespec.errors import CheckpointError
from moespec.io import TensorInfo, checkpoint_files, read_safetensors_into, write_sharded

INFOS = [TensorInfo(f"t{i}", (100,), torch.float32) for i in range(4)]  # 400 bytes each
SHARD_SIZES = {1: 10**9, 2: 800, 4: 400}  # --max-shard-size giving 1, 2 or 4 files (2 and 4 share no names)


def _write(path, files, value, force=True):
    return write_sharded(path, INFOS, lambda info: torch.full(info.shape, value), {}, max_shard_size=SHARD_SIZES[files],
                         force=force)


def _read(path) -> set[float]:
    """The values a reader gets, as `moespec.load` reads them: one value if the files come from one write."""
    _, files = checkpoint_files(path)
    targets = {info.name: torch.full(info.shape, float("nan")) for info in INFOS}
    for file in files:
        read_safetensors_into(file, targets)
    return {value for t in targets.values() for value in t.unique().tolist()}


def _killed_write(path, files, value, step) -> bool:
    """Write in a child process that SIGKILLs itself just before its `step`-th file-system change (rename,
    link or removal); False if it finished first."""
    pid = os.fork()
    if pid == 0:  # the child: count the changes, die at the chosen one
        calls = [0]

        def dying(original):
            def call(*args, **kwargs):
                calls[0] += 1
                if calls[0] == step:
                    os.kill(os.getpid(), signal.SIGKILL)
                return original(*args, **kwargs)
            return call

        for name in ("replace", "link", "unlink", "remove"):
            setattr(os, name, dying(getattr(os, name)))
        try:
            _write(path, files, value)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status)


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(2, 2), (2, 4), (1, 2), (2, 1)])
def test_a_write_killed_at_any_step_leaves_the_old_or_the_new_checkpoint(tmp_path, before, after):
    folder, steps = tmp_path / "out", 0
    path = folder / "model.safetensors"
    while True:
        steps += 1
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        _write(path, before, 1.0)
        if not _killed_write(path, after, 2.0, steps):
            break
        assert _read(path) in ({1.0}, {2.0}), f"killed at step {steps}"
        written = _write(path, 1, 3.0)  # the next forced write cleans up
        assert sorted(folder.iterdir()) == written and _read(path) == {3.0}, f"killed at step {steps}"
    assert steps > after + 1 and _read(path) == {2.0} and sorted(folder.iterdir()) == sorted(_write(path, after, 4.0))


def _index(path):
    return path.with_name(path.name + ".index.json")


def test_shards_of_different_writes_are_refused(tmp_path):
    a, b = tmp_path / "a" / "model.safetensors", tmp_path / "b" / "model.safetensors"
    _write(a, 2, 1.0)
    _write(b, 2, 2.0)
    shutil.copy(b.with_name("model-00002-of-00002.safetensors"), a.with_name("model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match=r"index.json: shards from different writes: model-00002-of-00002"
                                              r".safetensors has write id [0-9a-f]{32}, the index [0-9a-f]{32}; "
                                              r"the write that made them was interrupted or files were copied"):
        checkpoint_files(a)


def test_an_index_without_a_write_id_is_read_only_with_shards_without_one(tmp_path):
    path = tmp_path / "model.safetensors"
    _write(path, 2, 1.0)
    index = json.loads(_index(path).read_text())
    del index["metadata"]["moespec.write_id"]  # as transformers, timm or an older moespec write it
    _index(path).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="has write id [0-9a-f]{32}, the index none"):
        checkpoint_files(path)
    from safetensors.torch import load_file, save_file  # the same shards, written without a write id
    for name in set(index["weight_map"].values()):
        save_file(load_file(tmp_path / name), tmp_path / name)
    assert _read(path) == {1.0}


def test_a_malformed_write_id_names_no_file(tmp_path):
    path = tmp_path / "model.safetensors"
    _write(path, 2, 1.0)
    index = json.loads(_index(path).read_text())
    index["metadata"]["moespec.write_id"] = "../../x"
    _index(path).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="is not a write id"):
        checkpoint_files(path)

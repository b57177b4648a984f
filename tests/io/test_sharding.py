"""Writes never lose another checkpoint: an output already there is refused without --force, and with --force
only the files of its own layout (as its index names them) are replaced, whatever the names in the folder."""

from __future__ import annotations

import json

import pytest
import torch

from moespec.errors import MoespecError
from moespec.io import TensorInfo, write_sharded

INFOS = [TensorInfo(f"t{i}", (100,), torch.float32) for i in range(4)]  # 400 bytes each


def _write(path, shard_size=10**9, force=False):
    return write_sharded(path, INFOS, lambda info: torch.full(info.shape, float(info.name[1:])), {},
                         max_shard_size=shard_size, force=force)


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("name", ["m[1].safetensors", "*.safetensors", "model?.safetensors", "[a-z]*.safetensors"])
def test_a_name_with_glob_characters_leaves_other_checkpoints_alone(tmp_path, name):
    _write(tmp_path / "model.safetensors", shard_size=800)  # model-0000i-of-00002 + index
    _write(tmp_path / "other.safetensors")
    before = _snapshot(tmp_path)
    for shards in (10**9, 800):
        _write(tmp_path / name, shard_size=shards, force=True)
    after = _snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before


def test_a_single_file_over_a_sharded_output_is_refused_without_force(tmp_path):
    _write(tmp_path / "model.safetensors", shard_size=800)
    before = _snapshot(tmp_path)
    with pytest.raises(MoespecError, match="already exists.*--force"):
        _write(tmp_path / "model.safetensors")
    assert _snapshot(tmp_path) == before


def test_a_sharded_output_over_a_single_file_is_refused_without_force(tmp_path):
    _write(tmp_path / "model.safetensors")
    before = _snapshot(tmp_path)
    with pytest.raises(MoespecError, match="already exists"):
        _write(tmp_path / "model.safetensors", shard_size=800)
    assert _snapshot(tmp_path) == before


def test_force_replaces_exactly_the_old_layout_named_by_its_index(tmp_path):
    _write(tmp_path / "model.safetensors", shard_size=400)  # 4 shards
    stray = tmp_path / "model-00009-of-00009.safetensors"  # looks like a shard, but no index names it
    stray.write_bytes(b"keep me")
    files = _write(tmp_path / "model.safetensors", force=True)
    assert files == [tmp_path / "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-00009-of-00009.safetensors", "model.safetensors"]
    assert stray.read_bytes() == b"keep me"


def test_an_index_naming_files_outside_its_folder_never_removes_them(tmp_path):
    outside = tmp_path / "precious.safetensors"
    outside.write_bytes(b"x")
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "../precious.safetensors", "b": str(outside)}}))
    _write(folder / "model.safetensors", force=True)
    assert outside.read_bytes() == b"x" and not (folder / "model.safetensors.index.json").exists()

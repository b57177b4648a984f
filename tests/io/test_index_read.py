"""Reading a shard index: its entries are file names next to it, never paths elsewhere, and its shards hold
exactly the tensors its weight_map puts in them. Anything else is a CheckpointError naming the index."""

from __future__ import annotations

import json

import pytest
import torch

from moespec.errors import CheckpointError
from moespec.io import TensorInfo, checkpoint_files, write_sharded

INFOS = [TensorInfo(f"t{i}", (100,), torch.float32) for i in range(4)]  # 400 bytes each


@pytest.fixture
def sharded(tmp_path):
    """A checkpoint in 2 shards (t0, t1 | t2, t3) in `tmp_path/out`; returns its index."""
    folder = tmp_path / "out"
    folder.mkdir()
    write_sharded(folder / "model.safetensors", INFOS, lambda info: torch.full(info.shape, float(info.name[1:])), {},
                  max_shard_size=800)
    return folder / "model.safetensors.index.json"


def _edit(index, change):
    content = json.loads(index.read_text())
    change(content)
    index.write_text(json.dumps(content))


def test_a_valid_index_names_its_shards(sharded):
    _, files = checkpoint_files(sharded)
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.mark.parametrize("where", ["../elsewhere.safetensors", "ABSOLUTE", "sub/model.safetensors", "..", ""])
def test_an_entry_outside_the_index_folder_is_refused(sharded, where):
    outside = sharded.parent.parent / "elsewhere.safetensors"
    (sharded.parent / "model-00002-of-00002.safetensors").rename(outside)  # a real shard, but not next to the index
    where = str(outside) if where == "ABSOLUTE" else where

    def point_outside(content):
        content["weight_map"].update({"t2": where, "t3": where})

    _edit(sharded, point_outside)
    with pytest.raises(CheckpointError, match=f"model.safetensors.index.json: weight_map entry 't2': "
                                              f"'{where}' is not a file name"):
        checkpoint_files(sharded)


@pytest.mark.parametrize("content", [[], {"metadata": {}, "weight_map": []}, {"metadata": "x", "weight_map": {}},
                                     {"metadata": [], "weight_map": {}}, {"weight_map": {}}])
def test_an_index_of_the_wrong_shape_is_refused(sharded, content):
    sharded.write_text(json.dumps(content))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not a safetensors index"):
        checkpoint_files(sharded)


@pytest.mark.parametrize("value", [None, 3, ["model-00001-of-00002.safetensors"], {"a": "b"}])
def test_an_entry_that_is_not_a_string_is_refused(sharded, value):
    _edit(sharded, lambda content: content["weight_map"].update({"t0": value}))
    with pytest.raises(CheckpointError, match="weight_map entry 't0': .* is not a file name"):
        checkpoint_files(sharded)


def test_a_tensor_stored_in_another_shard_than_the_index_says_is_refused(sharded):
    _edit(sharded, lambda content: content["weight_map"].update({"t2": "model-00001-of-00002.safetensors"}))
    with pytest.raises(CheckpointError, match="puts 't2' in model-00001-of-00002.safetensors, which does not hold it"):
        checkpoint_files(sharded)


def test_a_tensor_the_index_does_not_name_is_refused(sharded):
    _edit(sharded, lambda content: content["weight_map"].pop("t3"))
    with pytest.raises(CheckpointError, match="holds 't3', but the weight_map does not name it"):
        checkpoint_files(sharded)


def test_a_tensor_no_shard_holds_is_refused(sharded):
    _edit(sharded, lambda content: content["weight_map"].update({"t9": "model-00001-of-00002.safetensors"}))
    with pytest.raises(CheckpointError, match="puts 't9' in model-00001-of-00002.safetensors, which does not hold it"):
        checkpoint_files(sharded)

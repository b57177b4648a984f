"""vmoe's checkpoint files, good and bad: checkpoints written here in vmoe's own layout (the same msgpack extension
types as `vmoe.checkpoints.serialization`, several shards, tensors split into chunks), and broken ones, each of
which is one clear error naming the file and the tensor."""

from __future__ import annotations

import shutil
import tracemalloc
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import moespec
from moespec.cli import app
from moespec.errors import CheckpointError
from moespec.io.vmoe_index import MAGIC, LegacyCheckpoint

DATA = Path(__file__).resolve().parent.parent / "data" / "vmoe"
REFERENCE = np.load(DATA / "reference.npz")
PARAMS = {name.removeprefix("param:"): REFERENCE[name] for name in REFERENCE.files if name.startswith("param:")}
EXPERTS_FC1 = "Encoder/encoderblock_1/Moe/Mlp/Dense_0/kernel"


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _slice_nd(chunk) -> bytes:
    return _pack(tuple(_pack((a, b, None)) for a, b in chunk))


def write_vmoe(prefix: Path, params: dict[str, np.ndarray], *, shards: int = 1, split: tuple[str, ...] = (),
               version: str | None = "20220622", shard_of=None) -> None:
    """`params` as vmoe's `partitioned.save_checkpoint` lays them out: leaves numbered in jax's order (sorted keys),
    leaf i in shard i % shards (or `shard_of(i, chunk)`), the tensors in `split` in two chunks along their first
    axis, each chunk in the next shard."""
    names = sorted(params, key=lambda n: n.split("/"))
    tree, data = {}, [{MAGIC: True} for _ in range(shards)]
    for leaf, name in enumerate(names):
        array = params[name]
        full = tuple((0, n) for n in array.shape)
        chunks = [full]
        if name in split:
            half = array.shape[0] // 2
            chunks = [((0, half), *full[1:]), ((half, array.shape[0]), *full[1:])]
        where = [shard_of(leaf, i) if shard_of else (leaf + i) % shards for i in range(len(chunks))]
        info = (_pack((list(array.shape), array.dtype.name, False, {})), tuple(_slice_nd(c) for c in chunks),
                tuple(where))
        node = tree
        for part in name.split("/")[:-1]:
            node = node.setdefault(part, {})
        node[name.split("/")[-1]] = msgpack.ExtType(8, _pack(info))
        for chunk, shard in zip(chunks, where, strict=True):
            if shard >= shards:  # an index naming a shard that is not there
                continue
            values = np.ascontiguousarray(array[tuple(slice(a, b) for a, b in chunk)]).reshape(-1)
            data[shard].setdefault(str(leaf), []).append(
                [[msgpack.ExtType(1, _pack((list(values.shape), values.dtype.name, values.tobytes())))],
                 msgpack.ExtType(6, _slice_nd(chunk))])
    index = {"shard_count": shards, "index": tree, **({"version": version} if version else {})}
    Path(f"{prefix}.index").write_bytes(_pack(index))
    for shard, content in enumerate(data):
        Path(f"{prefix}.data-{shard:05d}-of-{shards:05d}").write_bytes(_pack(content))


def _state(prefix) -> dict[str, torch.Tensor]:
    return moespec.import_vmoe(prefix, top_k=2, capacity_factor=1.05, group_size=10).state_dict()


@pytest.fixture(scope="module")
def reference_state():
    return _state(DATA / "vmoe_tiny")


def test_this_writer_writes_what_vmoe_wrote(tmp_path):
    write_vmoe(tmp_path / "same", PARAMS)
    ours, vmoe = LegacyCheckpoint(tmp_path / "same"), LegacyCheckpoint(DATA / "vmoe_tiny")
    assert [(e.name, e.shape, e.slices, e.shards) for e in ours.entries] == \
        [(e.name, e.shape, e.slices, e.shards) for e in vmoe.entries]


@pytest.mark.parametrize("version", ["20220622", None])
def test_several_shards_and_split_tensors_give_the_same_model(tmp_path, reference_state, version):
    write_vmoe(tmp_path / "sharded", PARAMS, shards=3, split=(EXPERTS_FC1, "embedding/kernel"), version=version)
    assert len(list(tmp_path.glob("sharded.data-*-of-00003"))) == 3
    state = _state(tmp_path / "sharded")
    assert all(torch.equal(state[name], reference_state[name]) for name in reference_state)


def test_a_truncated_shard(tmp_path):
    for file in DATA.glob("vmoe_tiny.*"):
        shutil.copy(file, tmp_path / file.name)
    shard = tmp_path / "vmoe_tiny.data-00000-of-00001"
    shard.write_bytes(shard.read_bytes()[:600_000])
    with pytest.raises(CheckpointError, match=rf"^{shard}: truncated: the file ends inside Encoder/\S+ \(600,000 "):
        _state(tmp_path / "vmoe_tiny")


def test_a_missing_shard_is_named_with_a_tensor_it_holds(tmp_path):
    write_vmoe(tmp_path / "two", PARAMS, shards=2)
    (tmp_path / "two.data-00001-of-00002").unlink()
    with pytest.raises(CheckpointError, match=r"two.data-00001-of-00002: missing: the shard 1 of .*two.index, which "
                                              r"holds Encoder/encoder_norm/scale"):
        _state(tmp_path / "two")


def test_an_index_that_names_a_shard_outside_the_checkpoint(tmp_path):
    write_vmoe(tmp_path / "bad", PARAMS, shards=1, shard_of=lambda leaf, chunk: 5 if leaf == 3 else 0)
    with pytest.raises(CheckpointError, match=r"bad.index: Encoder/encoderblock_0/LayerNorm_0/scale: names shard 5, "
                                              r"outside the 1 shards of this checkpoint"):
        LegacyCheckpoint(tmp_path / "bad")


def test_a_chunk_in_another_shard_than_the_index_says(tmp_path):
    write_vmoe(tmp_path / "moved", PARAMS, shards=2)
    index = LegacyCheckpoint(tmp_path / "moved")
    index.entries[0].shards[0] = 1 - index.entries[0].shards[0]  # as an index that disagrees with its shards
    with pytest.raises(CheckpointError, match="holds chunk .* which the index does not put in this shard"):
        list(index.tensors())


def test_a_tree_that_is_not_a_vmoe(tmp_path):
    write_vmoe(tmp_path / "other", {"layer/weights": np.zeros((3, 4), np.float32)})
    with pytest.raises(CheckpointError, match=r"other.index: no embedding/kernel: not a V-MoE .* it has layer/weights"):
        _state(tmp_path / "other")
    dense = {name: value for name, value in PARAMS.items() if "/Moe/" not in name}
    write_vmoe(tmp_path / "dense", dense)
    with pytest.raises(CheckpointError, match="no block has Moe/Router/dense/kernel: a dense ViT, not a V-MoE"):
        _state(tmp_path / "dense")
    extra = {**PARAMS, "Encoder/encoderblock_1/Moe/Router/dense/bias": np.zeros(4, np.float32)}
    write_vmoe(tmp_path / "extra", extra)
    with pytest.raises(CheckpointError, match="Router/dense/bias: not part of a V-MoE ViT"):
        _state(tmp_path / "extra")


def test_shapes_that_disagree(tmp_path):
    bias = "Encoder/encoderblock_1/Moe/Mlp/Dense_1/bias"
    write_vmoe(tmp_path / "shapes", {**PARAMS, bias: np.zeros((4, 63), np.float32)})
    with pytest.raises(CheckpointError, match=rf"shapes.index: {bias} is \[4, 63\], but the V-MoE the other tensors "
                                              r"give \(width 64, 2 heads, MLP 256, 4 experts\) has \[4, 64\]"):
        _state(tmp_path / "shapes")


def test_data_that_disagrees_with_its_index(tmp_path):
    write_vmoe(tmp_path / "short", PARAMS)
    shard = tmp_path / "short.data-00000-of-00001"
    content = msgpack.unpackb(shard.read_bytes(), ext_hook=msgpack.ExtType, strict_map_key=False)
    leaf = str(sorted(PARAMS, key=lambda n: n.split("/")).index("head/bias"))
    values = np.zeros(9, np.float32)
    content[leaf][0][0] = [msgpack.ExtType(1, _pack(([9], "float32", values.tobytes())))]
    shard.write_bytes(_pack(content))
    with pytest.raises(CheckpointError, match=rf"{shard}: head/bias: chunk \[0:10\] holds 9 values, not the 10"):
        _state(tmp_path / "short")


def test_the_cli_reports_a_bad_file_in_one_line(tmp_path):
    write_vmoe(tmp_path / "two", PARAMS, shards=2)
    (tmp_path / "two.data-00000-of-00002").unlink()
    result = CliRunner().invoke(app, ["import-vmoe", str(tmp_path / "two"), "-o", str(tmp_path / "out.safetensors"),
                                      "--group-size", "10"])
    assert result.exit_code == 2
    assert result.output.startswith(f"moespec: error: {tmp_path / 'two.data-00000-of-00002'}: missing: the shard 0")
    assert "Traceback" not in result.output and len(result.output.splitlines()) == 1
    assert not (tmp_path / "out.safetensors").exists()


def test_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """Eight 4 MB tensors in one shard: reading them one by one never holds much more than one."""
    tensors = {f"t/{i}": np.full((1024, 1024), i, np.float32) for i in range(8)}
    write_vmoe(tmp_path / "big", tensors)
    checkpoint = LegacyCheckpoint(tmp_path / "big")
    tracemalloc.start()
    try:
        for name, array in checkpoint.tensors():
            assert array[0, 0] == int(name.split("/")[1])
            del array
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * 4 * 1024 * 1024  # the tensor and change: the values go from the file into it

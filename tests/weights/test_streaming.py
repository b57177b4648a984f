"""Streaming upcycling into (sharded) safetensors: the same weights as the in-memory path, the transformers
shard layout, loading back, dtypes, the checks, and forced overwrites of an older layout."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors import safe_open

import moespec
from moespec.errors import CheckpointError
from moespec.weights import read_spec, upcycle, upcycle_to_checkpoint

from ..conftest import TINY_CONVNEXT, TINY_INPUT, TINY_VIT, family_net, make_spec

VIT = [{"where": {"every": 1}, "experts": 4, "top_k": 2, "router": {"normalize": True}}]
CONVNEXT = [{"where": {"stage_last": 2}, "experts": 4, "top_k": 1, "expert_mlp_ratio": 2}]


FAMILY = [{"where": {"every": 1}, "experts": 4, "top_k": 1}]


@pytest.mark.parametrize("backbone,moe", [(TINY_VIT, VIT), (TINY_CONVNEXT, CONVNEXT),
                                         (family_net("FastVitConvMlp"), FAMILY)], ids=["vit", "convnext", "pre module"])
def test_streamed_weights_equal_the_in_memory_upcycle(backbone, moe, dense_checkpoint, tmp_path):
    path, _ = dense_checkpoint(backbone)
    spec = make_spec(backbone, moe, upcycle={"noise": 0.01})
    out = tmp_path / "moe.safetensors"
    upcycle_to_checkpoint(spec, out, checkpoint=path, seed=3, check=False)
    expected = upcycle(spec, path, seed=3).state_dict()
    with safe_open(str(out), "pt") as f:
        assert set(f.keys()) == set(expected)
        for name in expected:
            assert torch.equal(f.get_tensor(name), expected[name]), name


def test_sharded_output_has_the_transformers_layout_and_loads(dense_checkpoint, tmp_path):
    path, dense = dense_checkpoint(TINY_VIT)
    spec = make_spec(TINY_VIT, VIT)
    out = tmp_path / "model.safetensors"
    done = []
    files, report = upcycle_to_checkpoint(spec, out, checkpoint=path, max_shard_size=400_000,
                                          on_layer=lambda *args: done.append(args))
    index = tmp_path / "model.safetensors.index.json"
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert files == [index, *shards] and len(shards) > 2 and not out.exists()
    assert all(s.name.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    for shard in shards:  # at most the limit, unless one tensor alone is larger
        with safe_open(str(shard), "pt") as f:
            sizes = [f.get_tensor(k).numel() * 4 for k in f.keys()]
        assert sum(sizes) <= 400_000 or len(sizes) == 1
    content = json.loads(index.read_text())
    model = upcycle(spec, path)
    assert set(content["weight_map"]) == set(model.state_dict())
    assert content["metadata"]["total_size"] == sum(t.numel() * 4 for t in model.state_dict().values())
    assert done == [("blocks.0.mlp", 0, 2), ("blocks.1.mlp", 1, 2), ("", 2, 2)]  # as each starts, then the end
    assert report.function_preserving and report.scope == "model"
    assert read_spec(out).to_yaml() == spec.to_yaml()
    for name in (out, index, tmp_path):  # by base path, index or folder alike
        loaded = moespec.load(name)
        x = torch.randn(2, *TINY_INPUT)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), dense(x), atol=1e-5, rtol=1e-5)


def test_bf16_output_is_checked_against_equally_rounded_dense_weights(dense_checkpoint, tmp_path):
    path, _ = dense_checkpoint(TINY_VIT)
    out = tmp_path / "moe.safetensors"
    _, report = upcycle_to_checkpoint(make_spec(TINY_VIT, VIT), out, checkpoint=path, dtype=torch.bfloat16)
    with safe_open(str(out), "pt") as f:
        assert f.get_tensor("blocks.0.mlp.experts.fc1.weight").dtype == torch.bfloat16
    assert report.function_preserving


def test_per_layer_check_for_models_too_large_to_compare_whole(dense_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules["moespec.weights.streaming"], "_memory_bytes", lambda: 1000)  # pretend nothing fits
    path, _ = dense_checkpoint(TINY_CONVNEXT)
    _, report = upcycle_to_checkpoint(make_spec(TINY_CONVNEXT, CONVNEXT), tmp_path / "m.safetensors", checkpoint=path)
    # experts keep 2/4 of the hidden units, so each layer's output differs from the FFN's: reported, per layer
    assert report.scope == "layers" and not report.function_preserving
    assert "over the MoE layers, each against its dense FFN" in str(report)
    _, report = upcycle_to_checkpoint(make_spec(TINY_VIT, VIT), tmp_path / "v.safetensors",
                                      checkpoint=dense_checkpoint(TINY_VIT, "vit.safetensors")[0])
    assert report.scope == "layers" and report.function_preserving


def test_forced_overwrite_replaces_an_older_layout_whole(dense_checkpoint, tmp_path):
    path, _ = dense_checkpoint(TINY_VIT)
    spec, out = make_spec(TINY_VIT, VIT), tmp_path / "model.safetensors"
    upcycle_to_checkpoint(spec, out, checkpoint=path, max_shard_size=400_000, check=False)
    with pytest.raises(moespec.MoespecError, match="already exists"):
        upcycle_to_checkpoint(spec, out, checkpoint=path, max_shard_size=400_000, check=False)
    upcycle_to_checkpoint(spec, out, checkpoint=path, force=True, check=False)  # one file now
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense.safetensors", "model.safetensors"]
    upcycle_to_checkpoint(spec, out, checkpoint=path, max_shard_size=400_000, force=True, check=False)
    assert not out.exists() and (tmp_path / "model.safetensors.index.json").exists()


def test_a_missing_shard_is_named(dense_checkpoint, tmp_path):
    path, _ = dense_checkpoint(TINY_VIT)
    out = tmp_path / "model.safetensors"
    files, _ = upcycle_to_checkpoint(make_spec(TINY_VIT, VIT), out, checkpoint=path, max_shard_size=400_000,
                                     check=False)
    files[2].unlink()
    with pytest.raises(CheckpointError, match=f"shard\\(s\\) missing next to it: {files[2].name}"):
        moespec.load(out)


def test_non_finite_dense_weights_are_refused(dense_checkpoint, tmp_path):
    from safetensors.torch import save_file

    _, dense = dense_checkpoint(TINY_VIT)
    state = {k: v.clone() for k, v in dense.state_dict().items()}
    state["blocks.1.attn.qkv.weight"][0, 0] = float("nan")
    bad = tmp_path / "nan.safetensors"
    save_file(state, str(bad))
    with pytest.raises(CheckpointError, match="blocks.1.attn.qkv.weight hold NaN or Inf"):
        upcycle_to_checkpoint(make_spec(TINY_VIT, VIT), tmp_path / "m.safetensors", checkpoint=bad)
    assert not (tmp_path / "m.safetensors").exists()

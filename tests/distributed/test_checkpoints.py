"""Checkpoints that do not care about the world size, and clear errors for bad use, on gloo ranks under
torchrun (`ckpt_worker.py`), each launch in a subprocess with a timeout."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import moespec
import moespec.distributed as md
from moespec.errors import MoespecError
from moespec.io import WRITE_ID_KEY, read_safetensors_header

from .launch import ROOT, torchrun

WORKER = ROOT / "tests" / "distributed" / "ckpt_worker.py"


def _results(out, mode: str, world: int) -> list[dict]:
    return [json.loads((out / f"{mode}-w{world}-rank{rank}.json").read_text()) for rank in range(world)]


def _content(file) -> tuple:
    """A file's bytes without its write id (each write has its own): the index's JSON, or a shard's header and
    data."""
    if file.name.endswith(".json"):
        index = json.loads(file.read_text())
        index["metadata"].pop(WRITE_ID_KEY)
        return index, b""
    header, start = read_safetensors_header(file)
    header["__metadata__"].pop(WRITE_ID_KEY)
    return header, file.read_bytes()[start:]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One launch on 2 ranks for the file, upcycling, inspection and error checks."""
    out = tmp_path_factory.mktemp("ckpt")
    torchrun(2, WORKER, "files,upcycle,inspect,errors", out)
    return out


@pytest.mark.slow
def test_save_of_a_sharded_model_writes_the_one_process_file_and_load_reads_slices(two_ranks):
    tmp_path = two_ranks
    assert _content(tmp_path / "ep.safetensors") == _content(tmp_path / "one.safetensors")
    shards = sorted(p.name for p in (tmp_path / "one-shards").iterdir())
    assert len(shards) > 2 and shards == sorted(p.name for p in (tmp_path / "ep-shards").iterdir())
    for name in shards:
        assert _content(tmp_path / "ep-shards" / name) == _content(tmp_path / "one-shards" / name), name
    for result in _results(tmp_path, "files", 2):
        assert result == {"load_diff": 0.0, "output_diff": 0.0}


@pytest.mark.slow
def test_distributed_upcycle_gives_each_rank_the_slice_of_one_process_upcycle(two_ranks):
    for result in _results(two_ranks, "upcycle", 2):
        assert result == {"weights_diff": 0.0, "fresh_diff": 0.0}


@pytest.mark.slow
def test_inspect_of_a_sharded_model_reports_every_ranks_images(two_ranks):
    for result in _results(two_ranks, "inspect", 2):
        assert result["same"], (result["report"], result["reference"])


@pytest.mark.slow
def test_training_state_saved_at_two_ranks_resumes_at_four_and_at_one(tmp_path):
    torchrun(2, WORKER, "train-save", tmp_path)
    torchrun(4, WORKER, "train-resume", tmp_path)
    subprocess.run([sys.executable, str(WORKER), "train-resume", str(tmp_path)], cwd=ROOT, check=True, timeout=300,
                   env={"PYTHONPATH": str(ROOT), "PATH": ""})  # one process, no torch.distributed
    uninterrupted = _results(tmp_path, "train-save", 2)[0]["losses"]
    for world in (4, 1):
        for result in _results(tmp_path, "train-resume", world):
            assert result["extra"]["step"] == 1
            assert result["losses"] == pytest.approx(uninterrupted, abs=1e-12), f"resumed at {world} rank(s)"


@pytest.mark.slow
def test_bad_use_gets_one_clear_error_on_every_rank(two_ranks):
    tmp_path = two_ranks
    for result in _results(tmp_path, "errors", 2):
        assert "already sharded" in result["twice"]
        assert "different specs" in result["mismatch"] and "rank 1" in result["mismatch"]
        assert str(tmp_path / "odd.safetensors") in result["uneven"]
        assert "3 experts" in result["uneven"] and "must divide" in result["uneven"] and "1, 3" in result["uneven"]


def test_sharding_without_a_process_group_says_what_to_do():
    spec = moespec.load_spec({"backbone": {"model": "vit_small_patch16_224", "kwargs": {
        "depth": 1, "img_size": 32, "embed_dim": 32, "num_heads": 2}}, "input_size": [3, 32, 32],
        "moe": [{"where": {"every": 1}, "experts": 2}]})
    model = moespec.create_model(spec, device="meta")
    for call in (lambda: md.shard_experts(model), lambda: md.load("x.safetensors"), lambda: md.upcycle(spec)):
        with pytest.raises(MoespecError, match="init_process_group"):
            call()


def test_clip_grad_norm_in_one_process_is_torchs():
    torch.manual_seed(0)
    spec = moespec.load_spec({"backbone": {"model": "vit_small_patch16_224", "kwargs": {
        "depth": 1, "img_size": 32, "embed_dim": 32, "num_heads": 2, "num_classes": 4}}, "input_size": [3, 32, 32],
        "moe": [{"where": {"every": 1}, "experts": 2}]})
    model = moespec.create_model(spec, seed=0)
    model(torch.randn(2, 3, 32, 32)).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    ours = md.clip_grad_norm_(model, 0.5)
    clipped = [p.grad.clone() for p in model.parameters()]
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g.clone()
    theirs = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    assert torch.allclose(ours, theirs, rtol=1e-6)
    for p, c in zip(model.parameters(), clipped, strict=True):
        assert torch.allclose(p.grad, c, rtol=1e-6)

"""A count runs the forward at batch 1 on the CPU, so an input size the schema allows can need more than the
machine has: such a count is refused after a forward on the meta device measured it (`counting/budget.py`),
before anything is allocated, and the counts of every other size are the counts as before."""

from __future__ import annotations

import os
import sys

import pytest

import moespec
from moespec import SpecError
from moespec.backbones import placement
from moespec.counting.budget import refuse_uncountable

from ..conftest import TINY_CONVNEXT, TINY_VIT, make_spec, measured_run, write

MOE = [{"where": {"last": 1}, "experts": 4}]


@pytest.mark.parametrize("backbone", [TINY_VIT, pytest.param(TINY_CONVNEXT, marks=pytest.mark.slow)],  # 5 s each
                         ids=["vit", "convnext"])
def test_stats_at_the_largest_input_size_is_refused_in_bounded_memory(tmp_path, backbone):
    """`stats --input-size 3 16384 16384` grew past 3 GB in 10-13 s (ViT and ConvNeXt) until it was killed."""
    path = write(tmp_path, make_spec(backbone, MOE).to_yaml())
    env = {**os.environ, "MOESPEC_CACHE_DIR": str(tmp_path / "cache")}
    code, stdout, stderr, seconds, peak_kb = measured_run(
        [sys.executable, "-m", "moespec.cli", "stats", str(path), "--input-size", "3", "16384", "16384"],
        timeout=90, env=env)
    assert (code, stdout, stderr.count("\n")) == (2, "", 1), stderr
    assert "input_size: counting MACs at input size [3, 16384, 16384] runs the forward on the CPU: about" in stderr
    assert "TMACs, more than the 4 T a count runs" in stderr
    assert peak_kb < 1_500_000, peak_kb  # measured: about 0.9 GB, as a count at 64 px (torch, timm, fvcore)


def test_a_count_whose_activations_do_not_fit_in_memory_is_refused(monkeypatch):
    """Few MACs but large activations (a ConvNeXt at 1,024 px: its stage-1 MLP's hidden layer alone is 100 MB)
    on a machine of 200 MB."""
    spec = make_spec(TINY_CONVNEXT, MOE)
    refuse_uncountable(spec, (3, 1024, 1024))
    monkeypatch.setattr(placement, "device_memory", lambda device: 200 * 10**6)
    with pytest.raises(SpecError) as error:
        refuse_uncountable(spec, (3, 1024, 1024))
    (problem,) = error.value.problems
    assert problem.path == "input_size"
    assert "of activations, more than 80% of this machine's memory (160.0 MB)" in problem.message
    with pytest.raises(SpecError, match="of activations, more than 80%"):
        moespec.stats(spec, input_size=(3, 1024, 1024))


def test_the_peak_counts_live_tensors_not_every_tensor_made():
    """ViT-S/16 at 224 px makes about 50 MB of activations in a forward, but holds a few MB at a time."""
    from moespec.backbones import create_backbone
    from moespec.counting.budget import LiveBytes
    from moespec.planning import input_refusal

    model = create_backbone(moespec.load_spec({"backbone": {"model": "vit_small_patch16_224"}}), device="meta")
    with LiveBytes() as live:
        assert input_refusal(model, (3, 224, 224)) is None
    assert 3 * 224 * 224 * 4 <= live.peak < 20 * 10**6 and live.current < live.peak

"""A ViT with a MAP head (timm's `AttentionPoolLatent`, SoViT-400m's pooling) counts, and a failure of the count
that is not the input size's is never reported as an `input_size` error (issue 51)."""

from __future__ import annotations

import importlib

import pytest
import timm

import moespec

from ..conftest import make_spec

# SoViT-400m's architecture (its MAP head, no class token, no final norm before the pool) at a tiny size.
TINY_SOVIT = {"model": "vit_so400m_patch14_siglip_224",
              "kwargs": {"img_size": 64, "patch_size": 16, "embed_dim": 32, "depth": 2, "num_heads": 2,
                         "mlp_ratio": 2, "num_classes": 10}}
MOE = [{"where": {"last": 1}, "experts": 4, "router": {"kind": "topk", "top_k": 1}}]


def _map_head_macs(dim: int, tokens: int, heads: int, hidden: int, classes: int) -> int:
    """timm's `AttentionPoolLatent` by hand on `tokens` tokens, one latent query: q (1 x dim x dim), kv (tokens x
    dim x 2 dim), QK^T and AV (heads x 1 x tokens x (2 x dim / heads)), proj (dim x dim), an affine LayerNorm (5
    per element, fvcore), its Mlp (fc1 + fc2), then the classifier."""
    return (dim * dim + tokens * dim * 2 * dim + heads * tokens * 2 * (dim // heads) + dim * dim + 5 * dim
            + 2 * dim * hidden + dim * classes)


def test_a_map_head_vit_counts_its_head_by_hand():
    s = moespec.stats(make_spec(TINY_SOVIT, MOE))
    model = timm.create_model(TINY_SOVIT["model"], **TINY_SOVIT["kwargs"])
    assert model.global_pool == "map" and model.cls_token is None
    assert s.dense_params == sum(p.numel() for p in model.parameters())
    avg = moespec.stats(make_spec({**TINY_SOVIT, "kwargs": {**TINY_SOVIT["kwargs"], "global_pool": "avg"}}, MOE))
    # The same model pooled by a mean (fvcore counts no MACs for it): timm then moves the final LayerNorm after
    # the pool (`fc_norm`, 1 token) where the MAP model normalizes all 16 tokens before its head. The difference
    # is the MAP head (with its classifier) + the norm on 16 tokens - the norm on 1 - the avg model's classifier.
    head = _map_head_macs(dim=32, tokens=16, heads=2, hidden=64, classes=10)
    assert round((s.dense_gmacs - avg.dense_gmacs) * 1e9) == head + 5 * 16 * 32 - 5 * 32 - 32 * 10 == 42_496
    expert, router = (32 * 64 + 64) + (64 * 32 + 32), 32 * 4
    assert s.total_params == s.dense_params + 3 * expert + router
    assert s.activated_params == s.dense_params + router


@pytest.mark.slow
def test_sovit_400m_counts():
    """timm's `vit_so400m_patch14_siglip_224` (the seed's SoViT-400m), a MAP head and no classifier: 427.68M
    parameters by timm's own count, and stats no longer fails."""
    s = moespec.stats(moespec.load_spec({"backbone": {"model": "vit_so400m_patch14_siglip_224"}, "moe": MOE}))
    assert s.dense_params == 427_680_704  # timm.create_model(...).parameters(), summed
    assert s.dense_gmacs == pytest.approx(110.26, rel=1e-3)


def test_a_count_that_fails_for_another_reason_names_no_field(monkeypatch):
    """A failure of fvcore's trace at an input size the model takes is moespec's: a RuntimeError that names the
    step, not a SpecError at `input_size`."""
    def broken(model, input_size):
        raise RuntimeError("Expected gradient function to be set")

    monkeypatch.setattr(importlib.import_module("moespec.counting.stats"), "count_macs", broken)
    with pytest.raises(RuntimeError, match=r"counting MACs of vit_so400m_patch14_siglip_224 at input size "
                                           r"\[3, 64, 64\] failed, though the model takes that input"):
        moespec.stats(make_spec(TINY_SOVIT, MOE))


def test_an_input_the_model_refuses_is_still_an_input_size_error():
    with pytest.raises(moespec.SpecError, match=r"input_size: the model cannot take input size \[3, 48, 48\]"):
        moespec.stats(moespec.load_spec({"backbone": TINY_SOVIT, "input_size": [3, 48, 48], "moe": MOE}))

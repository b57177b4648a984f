"""The counting conventions of `stats` (issue 51): `--dispatch-flops einsum` and `--attention-matmuls skip`,
each against a hand calculation on a tiny ViT."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import moespec
from moespec.cli import app

from ..conftest import make_spec

# A tiny ViT: 64 px in patches of 16 is 16 patches + [CLS] = 17 tokens of width 32, 2 heads, MLP 128, 2 blocks.
DIM, HIDDEN, TOKENS, DEPTH = 32, 128, 17, 2
VIT = {"model": "vit_small_patch16_224", "kwargs": {"depth": DEPTH, "img_size": 64, "embed_dim": DIM,
                                                    "num_heads": 2, "num_classes": 10}}
EXPERT = DIM * HIDDEN + HIDDEN * DIM  # MACs of one expert on one token: fc1 + fc2
GATE = DIM * 4  # a linear gate over 4 experts, per token


def _layer(router: dict, **conventions) -> float:
    s = moespec.stats(make_spec(VIT, [{"where": {"last": 1}, "experts": 4, "router": router}]), **conventions)
    (layer,) = s.layers
    return round(layer.gmacs * 1e9)


def test_einsum_dispatch_of_tokens_choice_grows_with_the_group():
    """Top-1, c = 1, groups of 2 images: S = 34 tokens, capacity ceil(1 * 1 * 34 / 4) = 9, E x C = 36 slots.
    Dispatch and combine: S x 36 x (32 + 32) per group, half a group per image; 36 / 2 = 18 expert rows per image
    (17 tokens, one slot padded). moespec's own count: 17 rows, each weighted into 32 output channels."""
    router = {"kind": "topk", "top_k": 1, "capacity_factor": 1.0, "group": 2}
    assert _layer(router) == TOKENS * GATE + TOKENS * (EXPERT + DIM)
    assert _layer(router, dispatch_flops="einsum") == TOKENS * GATE + 18 * EXPERT + TOKENS * 36 * (DIM + DIM)
    # One image a group: S = 17, capacity ceil(17 / 4) = 5, 20 slots, 20 rows.
    alone = {**router, "group": 1}
    assert _layer(alone, dispatch_flops="einsum") == TOKENS * GATE + 20 * EXPERT + TOKENS * 20 * (DIM + DIM)


def test_einsum_dispatch_of_expert_choice():
    """c = 1, one image a group: each expert takes round(1 x 17 / 4) = 4 tokens, 16 slots and 16 rows."""
    router = {"kind": "expert_choice", "capacity": 1.0, "group": 1}
    assert _layer(router) == TOKENS * GATE + 16 * (EXPERT + DIM)
    assert _layer(router, dispatch_flops="einsum") == TOKENS * GATE + 16 * EXPERT + TOKENS * 16 * (DIM + DIM)


def test_einsum_leaves_a_dropless_router_as_it_is():
    router = {"kind": "topk", "top_k": 2}
    assert _layer(router, dispatch_flops="einsum") == _layer(router) == TOKENS * GATE + 2 * TOKENS * (EXPERT + DIM)


def test_skipping_attention_matmuls_leaves_out_qk_and_av():
    """QK^T and AV: 2 x heads x N x N x head_dim = 2 x N^2 x 32 MACs per block."""
    spec = make_spec(VIT, [{"where": {"last": 1}, "experts": 4, "router": {"kind": "topk", "top_k": 1}}])
    counted, skipped = moespec.stats(spec), moespec.stats(spec, attention_matmuls="skip")
    products = DEPTH * 2 * TOKENS * TOKENS * DIM
    assert round((counted.dense_gmacs - skipped.dense_gmacs) * 1e9) == products == 36_992
    assert round((counted.gmacs - skipped.gmacs) * 1e9) == products
    assert skipped.total_params == counted.total_params and skipped.attention_matmuls == "skip"


def test_skipping_covers_attention_that_runs_as_plain_matmuls():
    """timm's attention with `fused_attn` off computes q @ k^T and attn @ v as matmuls; skip leaves them out too."""
    unfused = {**VIT, "kwargs": {**VIT["kwargs"], "depth": 1}}
    spec = make_spec(unfused, [{"where": {"last": 1}, "experts": 4, "router": {"kind": "topk", "top_k": 1}}])
    import timm.layers.config as config

    previous = config._USE_FUSED_ATTN
    config._USE_FUSED_ATTN = 0  # timm's switch: Attention(fused_attn=False)
    try:
        counted, skipped = moespec.stats(spec), moespec.stats(spec, attention_matmuls="skip")
    finally:
        config._USE_FUSED_ATTN = previous
    assert round((counted.dense_gmacs - skipped.dense_gmacs) * 1e9) == 2 * TOKENS * TOKENS * DIM


def test_the_cli_takes_both_options(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(json.dumps({"backbone": VIT, "input_size": [3, 64, 64], "moe": [
        {"where": {"last": 1}, "experts": 4, "router": {"kind": "expert_choice", "capacity": 1.0}}]}))
    result = CliRunner().invoke(app, ["stats", str(spec), "--dispatch-flops", "einsum", "--attention-matmuls", "skip",
                                      "-f", "json"])
    assert result.exit_code == 0, result.output
    (record,) = json.loads(result.stdout)
    assert (record["dispatch_flops"], record["attention_matmuls"]) == ("einsum", "skip")
    assert round(record["layers"][0]["gmacs"] * 1e9) == TOKENS * GATE + 16 * EXPERT + TOKENS * 16 * (DIM + DIM)
    bad = CliRunner().invoke(app, ["stats", str(spec), "--dispatch-flops", "onehot"])
    assert bad.exit_code == 2 and "onehot" in bad.output


def test_an_unknown_convention_is_refused_by_the_library():
    with pytest.raises(ValueError, match="dispatch_flops must be one of gather, einsum"):
        moespec.stats(make_spec(VIT, [{"where": {"last": 1}, "experts": 4}]), dispatch_flops="onehot")

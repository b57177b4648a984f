"""MACs: fvcore plus our handle table, and MoE layers costed analytically. Golden numbers by hand."""

from __future__ import annotations

import pytest
import torch

import moespec
from moespec.flops import MATMUL_LIKE, count_macs

from .conftest import SPECS_DIR, TINY_INPUT, TINY_VIT, make_spec

SPECS = sorted(SPECS_DIR.glob("*.yaml"))


def _vit_s16_macs() -> int:
    """ViT-S/16 at 224 by hand: 196 patches + cls = 197 tokens, width 384, 6 heads of 64, MLP 1536."""
    tokens, dim, hidden = 197, 384, 1536
    patch_embed = 196 * (3 * 16 * 16) * dim
    attention_products = 2 * 6 * tokens * tokens * 64  # QK^T and AV
    block = (tokens * dim * 3 * dim + attention_products + tokens * dim * dim + 2 * tokens * dim * hidden
             + 2 * 5 * tokens * dim)  # qkv, attention, proj, fc1 + fc2, two affine LayerNorms (5 per element)
    return patch_embed + 12 * block + 5 * tokens * dim + dim * 1000  # + final norm + head


def test_dense_vit_small_golden():
    s = moespec.stats(moespec.load_spec(SPECS_DIR / "vit_s16_dense.yaml"))
    assert s.dense_params == s.total_params == 22_050_664
    assert round(s.gmacs * 1e9) == _vit_s16_macs()
    assert s.gmacs == pytest.approx(4.25 + 0.36, rel=0.005)  # fvcore's 4.25 + attention products 0.36
    assert 12 * 2 * 6 * 197 * 197 * 64 / 1e9 == pytest.approx(0.36, abs=0.005)


def test_dense_convnext_tiny_golden():
    s = moespec.stats(moespec.load_spec(SPECS_DIR / "convnext_t_dense.yaml"))
    assert s.dense_params == 28_589_128
    assert s.gmacs == s.dense_gmacs == pytest.approx(4.47, rel=0.005)  # ConvNeXt paper / timm: 4.5 GFLOPs


# Hand-written architecture facts and surgery of each shipped MoE spec, one tuple per MoE layer:
# (width C, dense hidden, expert hidden, experts E, top_k, routed items per image).
VIT = dict(dim=384, hidden=1536, tokens=197)
CONVNEXT_STAGE2 = (384, 1536, 14 * 14)  # stages.2: width 384 at 224/16 = 14x14 positions
CONVNEXT_STAGE3 = (768, 3072, 7 * 7)
EXPECTED_LAYERS = {
    "vit_s16_dense": [],
    "convnext_t_dense": [],
    "vit_s16_moe8_every2_top2": [(384, 1536, 1536, 8, 2, 197)] * 6,  # blocks 1, 3, ..., 11
    "vit_s16_moe8_last2_top2": [(384, 1536, 1536, 8, 2, 197)] * 2,  # blocks 10, 11
    "convnext_t_moe4_last2_top1": [(384, 1536, 768, 4, 1, 196), (768, 3072, 1536, 4, 1, 49)],  # mlp_ratio 2
    "convnext_t_moe8_last2_top1": [(384, 1536, 1536, 8, 1, 196), (768, 3072, 3072, 8, 1, 49)],
}
DENSE = {"vit": (22_050_664, _vit_s16_macs()), "convnext": (28_589_128, 4.47e9)}


def _ffn_params(dim: int, hidden: int) -> int:
    return dim * hidden + hidden + hidden * dim + dim


def test_every_shipped_spec_has_a_hand_written_expectation():
    assert {p.stem for p in SPECS} == set(EXPECTED_LAYERS)


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_shipped_spec_counts_follow_the_formulas(path):
    s = moespec.stats(moespec.load_spec(path))
    dense_params, dense_macs = DENSE["vit" if path.stem.startswith("vit") else "convnext"]
    assert s.dense_params == dense_params
    assert s.dense_gmacs * 1e9 == pytest.approx(dense_macs, rel=0.005)
    total, activated, macs = s.dense_params, s.dense_params, s.dense_gmacs * 1e9
    for dim, dense_hidden, hidden, experts, top_k, items in EXPECTED_LAYERS[path.stem]:
        router = dim * experts
        # params: the dense FFN becomes E experts (narrower ones are FFNs of their own width) + the router
        total += experts * _ffn_params(dim, hidden) + router - _ffn_params(dim, dense_hidden)
        activated += top_k * _ffn_params(dim, hidden) + router - _ffn_params(dim, dense_hidden)
        # MACs per item: k expert FFNs instead of the dense one, + router, + the weighted combine (k * C)
        macs += items * (top_k * 2 * dim * hidden - 2 * dim * dense_hidden + router + top_k * dim)
    assert s.total_params == total
    assert s.activated_params == activated
    assert s.gmacs * 1e9 == pytest.approx(macs, rel=0.001)
    assert [(layer.items, layer.top_k, layer.experts) for layer in s.layers] == [
        (items, top_k, experts) for _, _, _, experts, top_k, items in EXPECTED_LAYERS[path.stem]]


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_no_matmul_like_op_is_left_uncounted(path):
    spec = moespec.load_spec(path)
    counted = count_macs(moespec.create_model(spec), moespec.plan(spec).input_size)
    assert not [op for op in counted.unsupported if MATMUL_LIKE.search(op)], counted.unsupported


def test_moe_cost_is_analytic_and_independent_of_routing():
    """E = k = 1 costs exactly the dense model plus, per token, the router (C x 1) and the combine (C)."""
    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 1, "top_k": 1}])
    s = moespec.stats(spec)
    tokens = (64 // 16) ** 2 + 1
    assert round(s.gmacs * 1e9) == round(s.dense_gmacs * 1e9) + 2 * tokens * (384 + 384)
    torch.manual_seed(1)
    other = moespec.stats(make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 8, "top_k": 2}]))
    torch.manual_seed(2)
    again = moespec.stats(make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 8, "top_k": 2}]))
    assert other.gmacs == again.gmacs


def test_capacity_factor_reports_the_padded_figure():
    spec = make_spec(TINY_VIT, [{"where": {"last": 1}, "experts": 4, "top_k": 2, "capacity_factor": 1.25}])
    layer = moespec.stats(spec).layers[0]
    tokens = 17
    capacity = -(-125 * 2 * tokens // (100 * 4))  # ceil(1.25 * 2 * 17 / 4) = 11
    expert = 2 * 384 * 1536
    assert layer.items == tokens
    assert round(layer.gmacs * 1e9) == tokens * (384 * 4 + 2 * expert + 2 * 384)
    assert round(layer.executed_gmacs * 1e9) == tokens * 384 * 4 + 4 * capacity * (expert + 384)


def test_input_size_override_and_a_size_the_model_cannot_take():
    spec = make_spec({"model": "convnext_tiny", "kwargs": {"depths": (1, 1, 2, 1)}}, [])
    small, large = moespec.stats(spec, input_size=(3, 64, 64)), moespec.stats(spec, input_size=(3, 128, 128))
    head = 5 * 768 + 768 * 1000  # LayerNorm + fc on the pooled vector: the same at any size
    assert large.input_size == (3, 128, 128)
    assert large.gmacs * 1e9 - head == pytest.approx(4 * (small.gmacs * 1e9 - head), rel=1e-9)  # 4x the pixels
    with pytest.raises(moespec.SpecError, match=r"cannot take input size \[3, 96, 96\]"):
        moespec.stats(make_spec(TINY_VIT, []), input_size=(3, 96, 96))
    assert TINY_INPUT == [3, 64, 64]

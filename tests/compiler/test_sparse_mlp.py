"""Sparse-MLP on MLP-Mixer: rescale sub-layers, token- and channel-mixing MoE, upcycling, counts by hand."""

from __future__ import annotations

import math

import pytest
import torch
from timm.models.mlp_mixer import MixerBlock

import moespec
from moespec.backbones import create_backbone
from moespec.compiler import compile_graph
from moespec.layers import MoE
from moespec.weights import upcycle_with_report

from ..conftest import SPECS_DIR, line_of, randomize, write

# A small Mixer: 3 blocks, C = 64, 64 px images of 16 px patches -> S = 16; D_S = 32, D_C = 256 (ratios 0.5, 4).
MIXER = {"model": "mixer_b16_224", "kwargs": {"num_blocks": 3, "embed_dim": 64, "img_size": 64, "num_classes": 10}}
SMALL = {
    "backbone": MIXER, "input_size": [3, 64, 64],
    "rescale": {"where": {"last": 1}, "tokens": 2.0, "channels": 0.5},  # S1 = 32, C1 = 32
    "moe": [
        {"where": {"last": 1}, "sublayer": "mlp_tokens", "experts": 4, "top_k": 1, "expert_hidden": 24,
         "router": {"drop_fraction": 0.25}},
        {"where": {"last": 1}, "sublayer": "mlp_channels", "experts": 2, "top_k": 2, "expert_hidden": 48},
    ],
}


def _ffn(dim, hidden):
    return dim * hidden + hidden + hidden * dim + dim


def test_small_mixer_counts_by_hand():
    s = moespec.stats(moespec.load_spec(SMALL))
    # dense: patch embed 3*16*16*64 + 64; per block 2 LayerNorms + token MLP 16->32->16 + channel MLP 64->256->64;
    # final norm; head 64 -> 10
    block = 4 * 64 + _ffn(16, 32) + _ffn(64, 256)
    dense = (3 * 16 * 16 * 64 + 64) + 3 * block + 2 * 64 + (64 * 10 + 10)
    assert s.dense_params == dense == 153_242
    rescales = (16 * 32 + 32) + (64 * 32 + 32) + (32 * 16 + 16) + (32 * 64 + 64)  # in: S->S1, C->C1; out: back
    moe_s, moe_c = 4 * _ffn(32, 24) + 32 * 4, 2 * _ffn(32, 48) + 32 * 2  # experts + routers at S1 = C1 = 32
    assert s.total_params == dense - block + rescales + 4 * 32 + moe_s + moe_c
    assert s.activated_params == s.total_params - 3 * _ffn(32, 24)  # MoE_S uses 1 of 4 experts
    # MACs. Dense: patch embed, per block 2 norms (5 per element) + token MLP on 64 rows + channel MLP on 16 rows.
    block_macs = 2 * 5 * 16 * 64 + 64 * 2 * 16 * 32 + 16 * 2 * 64 * 256
    dense_macs = 16 * 768 * 64 + 3 * block_macs + 5 * 16 * 64 + 64 * 10
    assert round(s.dense_gmacs * 1e9) == dense_macs
    kept = 32 - math.floor(0.25 * 32)  # importance-score routing dispatches 24 of the 32 channel rows
    sparse_block = (64 * 16 * 32 + 32 * 64 * 32  # pro-token rescale: token map on 64 rows, channel map on 32
                    + 2 * 5 * 32 * 32  # norms at [32, 32]
                    + 32 * 32 * 4 + kept * (2 * 32 * 24 + 32)  # MoE_S: gate on 32 rows, 1 expert + combine per kept row
                    + 32 * 32 * 2 + 32 * 2 * (2 * 32 * 48 + 32)  # MoE_C: gate on 32 patches, 2 experts + combine each
                    + 32 * 32 * 16 + 16 * 32 * 64)  # pro-channel rescale back to [16, 64]
    assert round(s.gmacs * 1e9) == dense_macs - block_macs + sparse_block
    assert [(layer.path, layer.items) for layer in s.layers] == [("blocks.2.mlp_tokens", 32),
                                                                  ("blocks.2.mlp_channels", 32)]


def test_plan_shows_the_rescale_and_the_graph_has_it():
    spec = moespec.load_spec(SMALL)
    plan = moespec.plan(spec)
    assert str(plan.rescales[0]) == "rescale blocks.2: [16, 64] -> [32, 32] (rebuilt, hidden 24 / 48) -> [16, 64]"
    assert "rescale blocks.2" in str(plan)
    graph = compile_graph(create_backbone(spec), plan)
    called = [n.target for n in graph.graph.nodes if n.op == "call_module" and n.target.startswith("blocks.2")]
    assert called[0] == "blocks.2.rescale_in" and called[-1] == "blocks.2.rescale_out"
    assert "blocks.2.mlp_tokens" in called and "blocks.2.mlp_channels" in called
    model = moespec.create_model(spec)
    assert isinstance(model.blocks[2], MixerBlock) and type(model.blocks[2]).__name__ == "RescaledMixerBlock"
    tokens = model.get_submodule("blocks.2.mlp_tokens")
    assert isinstance(tokens, MoE) and tokens.experts.in_features == 32 and tokens.experts.hidden == 24


def test_token_and_channel_moe_train_and_both_aux_losses_count():
    model = randomize(moespec.create_model(moespec.load_spec(SMALL))).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 3, 64, 64)
    model(x)
    layers = moespec.moe_layers(model)
    expected = sum(0.01 * layer.aux_losses["importance_load"] for layer in layers.values())
    torch.testing.assert_close(moespec.aux_loss(model), expected)
    optimizer.zero_grad()
    moespec.aux_loss(model).backward()  # the aux loss alone reaches both routers
    for layer in layers.values():
        assert layer.router.gate.weight.grad.abs().sum() > 0
    optimizer.zero_grad()
    (model(x).square().mean() + moespec.aux_loss(model)).backward()
    optimizer.step()
    assert layers["blocks.2.mlp_tokens"].last_items == 2 * 32  # B * C1 channel rows
    assert layers["blocks.2.mlp_tokens"].routing_stats()["drop_fraction"] == pytest.approx(0.25)
    assert layers["blocks.2.mlp_channels"].last_items == 2 * 32  # B * S1 patches


def test_upcycle_copies_dense_blocks_and_says_which_blocks_are_fresh(tmp_path):
    dense = randomize(create_backbone(moespec.load_spec({"backbone": MIXER}))).eval()  # timm would refuse num_blocks
    torch.save(dense.state_dict(), tmp_path / "mixer.pth")
    spec = moespec.load_spec({**SMALL, "moe": SMALL["moe"] + [
        {"where": {"first": 1}, "sublayer": "mlp_tokens", "experts": 4, "top_k": 4, "router": {"normalize": True}}]})
    model, report = upcycle_with_report(spec, tmp_path / "mixer.pth")
    state, dense_state = model.state_dict(), dense.state_dict()
    for key in ("stem.proj.weight", "blocks.1.mlp_channels.fc1.weight", "norm.weight", "head.weight"):
        assert torch.equal(state[key], dense_state[key])
    # token-mixing MoE without rescale upcycles from mlp_tokens like any FFN
    for e in range(4):
        assert torch.equal(state["blocks.0.mlp_tokens.experts.fc1.weight"][e],
                           dense_state["blocks.0.mlp_tokens.fc1.weight"])
    assert str(report).splitlines()[-1] == ("  blocks.2: rebuilt at [32, 32] (rescale.0) and freshly initialized; "
                                            "a block of a new shape cannot be upcycled")


@pytest.mark.parametrize("rescale,field,fragment", [
    ("{where: {last: 1}, tokens: 1.3}", "rescale.0.tokens",
     "1.3 x 16 tokens of blocks.2 = 20.8 is not a whole number"),
    ("{where: {last: 1}, channels: 0.3}", "rescale.0.channels",
     "0.3 x 64 channels of blocks.2 = 19.2 is not a whole number"),
])
def test_non_integer_rescaled_sizes_are_spec_errors(tmp_path, rescale, field, fragment):
    text = ("backbone:\n  model: mixer_b16_224\n  kwargs: {num_blocks: 3, embed_dim: 64, img_size: 64}\n"
            f"rescale: {rescale}\n")
    path = write(tmp_path, text)
    with pytest.raises(moespec.SpecError) as err:
        moespec.plan(moespec.load_spec(path))
    problem = err.value.problems[0]
    assert (problem.path, problem.line) == (field, line_of(text, "rescale:"))
    assert fragment in problem.message


def test_rescale_needs_mixer_blocks(tmp_path):
    path = write(tmp_path, "backbone: {model: vit_small_patch16_224}\nrescale: {where: {last: 1}, tokens: 2.0}\n")
    with pytest.raises(moespec.SpecError, match="blocks.11 is a Block; rescale rebuilds only MixerBlock blocks"):
        moespec.plan(moespec.load_spec(path))


# Sparse-S / B / L as the paper defines them: (timm model, blocks, C, D_S, D_C, sparse blocks,
# S1, C1, MoE_S (experts, hidden), MoE_C (experts, top_k, hidden) or a plain MLP (0, _, hidden)).
SPARSE_SPECS = {
    "sparse_mlp_s": ("mixer_s16_224", 8, 512, 256, 2048, 2, 392, 512, (4, 512), (0, 1, 2048)),
    "sparse_mlp_b": ("mixer_b16_224", 12, 768, 384, 3072, 2, 392, 384, (8, 768), (4, 2, 1536)),
    "sparse_mlp_l": ("mixer_b16_224", 14, 768, 384, 3072, 6, 392, 384, (16, 768), (4, 2, 1536)),
}


@pytest.mark.parametrize("name", SPARSE_SPECS)
def test_sparse_mlp_specs_by_hand(name):
    _, blocks, dim, d_s, d_c, sparse, s1, c1, (e_s, h_s), (e_c, k_c, h_c) = SPARSE_SPECS[name]
    s = moespec.stats(moespec.load_spec(SPECS_DIR / f"{name}.yaml"))
    tokens = 196  # 224 / 16 = 14 x 14 patches
    block = 4 * dim + _ffn(tokens, d_s) + _ffn(dim, d_c)
    dense = (3 * 16 * 16 * dim + dim) + blocks * block + 2 * dim + dim * 1000 + 1000
    assert s.dense_params == dense
    rescales = (tokens * s1 + s1) + (dim * c1 + c1) + (s1 * tokens + tokens) + (c1 * dim + dim)
    moe_s = e_s * _ffn(s1, h_s) + s1 * e_s
    moe_c = e_c * _ffn(c1, h_c) + c1 * e_c if e_c else _ffn(c1, h_c)
    assert s.total_params == dense + sparse * (rescales + 4 * c1 + moe_s + moe_c - block)
    unused = (e_s - 1) * _ffn(s1, h_s) + ((e_c - k_c) * _ffn(c1, h_c) if e_c else 0)
    assert s.activated_params == s.total_params - sparse * unused
    block_macs = 2 * 5 * tokens * dim + dim * 2 * tokens * d_s + tokens * 2 * dim * d_c
    dense_macs = tokens * 768 * dim + blocks * block_macs + 5 * tokens * dim + dim * 1000
    assert s.dense_gmacs * 1e9 == pytest.approx(dense_macs, rel=1e-9)
    kept = c1 - math.floor(0.1 * c1)  # importance-score routing keeps 90% of the C1 channel rows
    sparse_macs = (dim * tokens * s1 + s1 * dim * c1 + 2 * 5 * s1 * c1
                   + c1 * s1 * e_s + kept * (2 * s1 * h_s + s1)
                   + (s1 * c1 * e_c + s1 * k_c * (2 * c1 * h_c + c1) if e_c else s1 * 2 * c1 * h_c)
                   + c1 * s1 * tokens + tokens * c1 * dim)
    assert s.gmacs * 1e9 == pytest.approx(dense_macs + sparse * (sparse_macs - block_macs), rel=1e-9)

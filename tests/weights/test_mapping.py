"""The dense -> MoE state mapping that every upcycling path reads a dense checkpoint through."""

from __future__ import annotations

import moespec
from moespec.backbones import create_backbone
from moespec.weights.mapping import dense_to_moe

from ..compiler.test_sparse_mlp import MIXER, SMALL
from ..conftest import TINY_VIT, make_spec


def test_names_outside_moe_layers_are_plain_and_each_ffn_is_cut_out_by_its_prefix():
    spec = make_spec(TINY_VIT, [{"where": {"last": 1}, "experts": 4, "top_k": 1}])
    dense = create_backbone(spec, device="meta").state_dict()
    plain, ffns = dense_to_moe(moespec.plan(spec), dense)
    assert list(ffns) == ["blocks.1.mlp"]
    assert ffns["blocks.1.mlp"] == {name.removeprefix("blocks.1.mlp."): tensor for name, tensor in dense.items()
                                    if name.startswith("blocks.1.mlp.")}
    assert set(ffns["blocks.1.mlp"]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert plain == {name: tensor for name, tensor in dense.items() if not name.startswith("blocks.1.mlp.")}
    assert all(plain[name] is dense[name] for name in plain)  # the dense tensors themselves, not copies
    assert "blocks.0.mlp.fc1.weight" in plain and "blocks.1.norm2.weight" in plain


def test_a_rebuilt_block_is_in_neither_part():
    spec = moespec.load_spec({**SMALL, "moe": SMALL["moe"] + [
        {"where": {"first": 1}, "sublayer": "mlp_tokens", "experts": 4, "top_k": 1}]})
    dense = create_backbone(moespec.load_spec({"backbone": MIXER}), device="meta").state_dict()
    plain, ffns = dense_to_moe(moespec.plan(spec), dense)
    assert list(ffns) == ["blocks.0.mlp_tokens"]  # blocks.2's MoE layers are in the rebuilt block
    assert not any(name.startswith(("blocks.2.", "blocks.0.mlp_tokens.")) for name in plain)
    assert set(plain) | {f"blocks.0.mlp_tokens.{name}" for name in ffns["blocks.0.mlp_tokens"]} == {
        name for name in dense if not name.startswith("blocks.2.")}

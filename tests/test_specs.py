"""Every shipped spec loads, plans, compiles and runs, and says which published design it encodes."""

from __future__ import annotations

import pytest
import torch

import moespec

from .conftest import SPECS_DIR

SPECS = sorted(SPECS_DIR.glob("*.yaml"))
REAL_BUILD_LIMIT = 150_000_000  # parameters: larger specs compile on the meta device only, to keep tests fast
TOO_LARGE = 3_000_000_000  # parameters: 12+ GB of fp32 weights, marked as too large to instantiate here


def test_the_required_specs_are_shipped():
    names = {p.stem for p in SPECS}
    assert {"vit_s16_moe8_every2_top2", "vit_s16_moe8_last2_top2", "convnext_t_moe4_last2_top1",
            "convnext_t_moe8_last2_top1", "vit_s16_dense", "convnext_t_dense"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_shipped_spec_compiles_and_runs(path):
    text = path.read_text()
    lines = text.splitlines()
    assert lines[0].startswith("# yaml-language-server: $schema="), "each spec points editors at the schema"
    assert lines[1].startswith("# "), "then a comment names the published configuration it encodes"
    spec = moespec.load_spec(path)
    plan = moespec.plan(spec)
    meta = moespec.create_model(spec, device="meta")
    params = sum(p.numel() for p in meta.parameters())
    assert len(moespec.moe_layers(meta)) == len(plan.layers)
    assert ("Too large to instantiate here" in text) == (params > TOO_LARGE), params
    if params > REAL_BUILD_LIMIT:
        return
    model = moespec.create_model(spec)
    with torch.no_grad():
        logits = model(torch.randn(1, *plan.input_size))
    assert logits.shape == (1, 1000) and torch.isfinite(logits).all()


def test_published_placements():
    def paths(name):
        return [layer.path for layer in moespec.plan(moespec.load_spec(SPECS_DIR / name)).layers]

    assert paths("vit_s16_moe8_every2_top2.yaml") == [f"blocks.{i}.mlp" for i in (1, 3, 5, 7, 9, 11)]
    assert paths("vit_s16_moe8_last2_top2.yaml") == ["blocks.10.mlp", "blocks.11.mlp"]
    assert paths("convnext_t_moe4_last2_top1.yaml") == ["stages.2.blocks.8.mlp", "stages.3.blocks.2.mlp"]
    assert paths("convnext_t_moe8_last2_top1.yaml") == ["stages.2.blocks.8.mlp", "stages.3.blocks.2.mlp"]

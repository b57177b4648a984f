"""The shipped upcycling recipes (`specs/upcycle_*.yaml`), each upcycled at a tiny size: the paper's settings
reach the model, and the report says what the start is."""

from __future__ import annotations

import pytest
import torch
import yaml

import moespec
from moespec.weights import upcycle_with_report

from ..conftest import SPECS_DIR
from .test_upcycle_sources import INPUT, SMALL, two_sources

RECIPES = sorted(SPECS_DIR.glob("upcycle_*.yaml"))


def tiny(path) -> moespec.Spec:
    """The recipe with the tiny ViT of `SMALL` as its backbone (2 blocks: "every 2" keeps block 1)."""
    document = yaml.safe_load(path.read_text())
    return moespec.load_spec({**document, "backbone": SMALL, "input_size": INPUT})


def test_three_recipes_are_shipped_with_their_papers():
    assert [p.stem for p in RECIPES] == ["upcycle_vit_b16_ec32_every2", "upcycle_vit_s16_drop_e8_top2",
                                         "upcycle_vit_s16_multisource_e4_top2"]
    for path, paper in zip(RECIPES, ("Komatsuzaki et al.", "Nakamura et al.", "mergekit-moe"), strict=True):
        assert paper in path.read_text().split("\nname:")[0]


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_each_recipe_upcycles_and_reports_its_start(path, dense_checkpoint):
    paths, states = two_sources(dense_checkpoint)
    spec = tiny(path)
    several = spec.upcycle.router_init == "hidden"
    images = [torch.randn(4, *INPUT, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    model, report = upcycle_with_report(spec, paths if several else paths[0], images=images if several else None)
    layer = spec.moe[0]
    starts = {start.path: start.experts_from for start in report.starts}
    expected = [i % 2 for i in range(layer.experts)] if several else [0] * layer.experts
    assert all(list(experts) == expected for experts in starts.values()) and starts
    assert len(report.source_errors) == (2 if several else 1) and all(e >= 0 for e in report.source_errors)
    fc1 = model.state_dict()[f"{next(iter(starts))}.experts.fc1.weight"]
    dense_fc1 = states[0][f"{next(iter(starts))}.fc1.weight"]
    changed = (fc1[0] != dense_fc1).any(dim=1).sum().item()
    assert changed == (64 if spec.upcycle.drop == 0.5 else 0)  # Drop-Upcycling: half of 128 hidden units

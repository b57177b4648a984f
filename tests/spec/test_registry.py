"""The spec's registries: a selector or router kind registered after import reaches validation, the plan and
the JSON Schema at once, and leaves with its registration."""

from __future__ import annotations

from typing import ClassVar, Literal

import pytest
import torch

import moespec
from moespec.errors import SpecError
from moespec.spec import BlockLayout, json_schema, register_selector, unregister_selector
from moespec.spec.selectors import Selector

from ..conftest import TINY_INPUT

VIT_DEPTH_4 = {"model": "vit_small_patch16_224", "kwargs": {"depth": 4, "img_size": 64, "num_classes": 10}}


class Odd(Selector):
    """Blocks 1, 3, 5, ...: a selector written outside moespec."""

    FORM: ClassVar[str] = "{odd: true}"
    odd: Literal[True]

    def resolve(self, layout: BlockLayout) -> list[int]:
        return [block.index for block in layout.blocks if block.index % 2 == 1]


def _spec(where: dict) -> dict:
    return {"backbone": VIT_DEPTH_4, "input_size": TINY_INPUT, "moe": [{"where": where, "experts": 2}]}


@pytest.fixture
def odd_selector():
    register_selector("odd")(Odd)
    yield
    unregister_selector("odd")


def test_an_unregistered_selector_is_an_error_that_lists_the_forms():
    with pytest.raises(SpecError, match=r"a selector is one of \{every: N\}"):
        moespec.load_spec(_spec({"odd": True}))


def test_a_selector_registered_after_import_validates_plans_and_builds(odd_selector):
    spec = moespec.load_spec(_spec({"odd": True}))
    assert [layer.path for layer in moespec.plan(spec).layers] == ["blocks.1.mlp", "blocks.3.mlp"]
    model = moespec.create_model(spec, seed=0)
    assert model(torch.randn(1, *TINY_INPUT)).shape == (1, 10)
    assert "Odd" in json_schema()["$defs"]


def test_its_options_are_checked_like_the_built_in_ones(odd_selector):
    with pytest.raises(SpecError) as error:
        moespec.load_spec(_spec({"odd": False}))
    assert error.value.problems[0].path == "moe.0.where.odd"


def test_unregistering_takes_it_out_of_validation_again(odd_selector):
    unregister_selector("odd")
    with pytest.raises(SpecError, match="a selector is one of"):
        moespec.load_spec(_spec({"odd": True}))
    register_selector("odd")(Odd)  # for the fixture's teardown


def test_create_model_seed_is_the_global_seed_without_touching_it():
    spec = moespec.load_spec(_spec({"every": 2}))
    torch.manual_seed(0)
    by_global = moespec.create_model(spec).state_dict()
    before = torch.random.get_rng_state()
    by_seed = moespec.create_model(spec, seed=0).state_dict()
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(by_global[name], by_seed[name]) for name in by_global)

"""The plan: a Spec plus its dense model give a frozen Plan of plain numbers and the typed router specs
(moespec.planning)."""

from __future__ import annotations

import dataclasses

import pydantic
import pytest
from pydantic import BaseModel

import moespec
from moespec.backbones import create_backbone
from moespec.errors import SpecError
from moespec.planning import LayerPlan, Plan, plan_for
from moespec.routers import Gate
from moespec.routers.expert_choice import ExpertChoiceRouterSpec
from moespec.routers.image import ImageRouterSpec

from ..conftest import TINY_CONVNEXT, TINY_INPUT, TINY_VIT, make_spec, write

# ViT-S/16 at depth 2: embed 384, MLP hidden 4 * 384 = 1536. ConvNeXt-T dims 96, 192, 384, 768 (hidden 4x).
VIT_DIM, VIT_HIDDEN = 384, 1536


def _pydantic_objects(value, where="plan") -> list[str]:
    """Every pydantic model reachable from `value` (dataclass fields, dicts, lists, tuples)."""
    if isinstance(value, BaseModel):
        return [where]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [w for f in dataclasses.fields(value) for w in _pydantic_objects(getattr(value, f.name),
                                                                                f"{where}.{f.name}")]
    if isinstance(value, dict):
        return [w for k, v in value.items() for w in _pydantic_objects(v, f"{where}[{k!r}]")]
    if isinstance(value, (list, tuple)):
        return [w for i, v in enumerate(value) for w in _pydantic_objects(v, f"{where}[{i}]")]
    return []


def test_layer_widths_experts_and_router_come_from_the_group_and_the_model():
    spec = make_spec(TINY_VIT, [
        {"where": {"blocks": [0]}, "experts": 4, "expert_hidden": 256, "shared_experts": 1,
         "router": {"kind": "topk", "top_k": 2, "capacity_factor": 1.5, "normalize": True, "gate": "cosine"}},
        {"where": {"blocks": [1]}, "experts": 8, "expert_mlp_ratio": 2.0, "router": {"kind": "expert_choice"}},
    ])
    first, second = moespec.plan(spec).layers
    assert (first.path, first.block, first.group, first.family) == ("blocks.0.mlp", 0, 0, "Mlp")
    assert (first.in_features, first.dense_hidden, first.expert_hidden, first.out_features) == (
        VIT_DIM, VIT_HIDDEN, 256, VIT_DIM)
    assert (first.num_experts, first.shared_experts) == (4, 1)
    assert first.router is spec.moe[0].router  # the typed router spec travels unchanged
    assert (first.router.top_k, first.router.capacity_factor, first.router.normalize) == (2, 1.5, True)
    assert first.router.gate == Gate(kind="cosine")
    assert first.channels_dim == -1
    assert second.expert_hidden == 2 * VIT_DIM  # expert_mlp_ratio 2 of the input width 384
    assert second.router == ExpertChoiceRouterSpec(kind="expert_choice", capacity=1.0)


def test_a_previous_release_group_plans_as_its_new_form():
    """Release 0.1 wrote top_k and capacity_factor on the group (`spec.compat`): the same plan."""
    old = make_spec(TINY_VIT, [{"where": {"blocks": [0]}, "experts": 4, "top_k": 2, "capacity_factor": 1.5,
                                "router": {"kind": "topk", "normalize": True}}])
    new = make_spec(TINY_VIT, [{"where": {"blocks": [0]}, "experts": 4,
                                "router": {"kind": "topk", "normalize": True, "top_k": 2, "capacity_factor": 1.5}}])
    assert old == new
    assert str(moespec.plan(old)) == str(moespec.plan(new))


def test_the_plan_holds_plain_data_and_the_frozen_router_specs():
    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 2, "router": {"kind": "image"}}])
    plan = moespec.plan(spec)
    assert _pydantic_objects(plan) == ["plan.layers[0].router", "plan.layers[1].router"]
    assert all(isinstance(layer.router, ImageRouterSpec) for layer in plan.layers)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.name = "other"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.layers[0].num_experts = 3
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        plan.layers[0].router.top_k = 2
    assert isinstance(plan, Plan) and all(isinstance(layer, LayerPlan) for layer in plan.layers)


def test_aux_loss_weights_are_summed_per_kind():
    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 2, "aux_loss": [
        {"kind": "switch", "weight": 0.01}, {"kind": "switch", "weight": 0.02}, {"kind": "z_loss", "weight": 0.001}]}])
    weights = moespec.plan(spec).layers[0].aux_loss_weights
    assert weights.keys() == {"switch", "z_loss"}
    assert weights["switch"] == pytest.approx(0.03) and weights["z_loss"] == pytest.approx(0.001)


def test_soft_moe_has_no_aux_loss_and_image_routing_resolves_its_pool_from_the_model():
    soft = moespec.plan(make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4, "router": {"kind": "soft"}}]))
    assert soft.layers[0].aux_loss_weights == {}
    vit = moespec.plan(make_spec(TINY_VIT, [{"where": {"last": 1}, "experts": 2, "router": {"kind": "image"}}]))
    convnext = moespec.plan(make_spec(TINY_CONVNEXT, [{"where": {"last": 1}, "experts": 2,
                                                       "router": {"kind": "image"}}]))
    assert vit.layers[0].router.pool == "cls"  # timm's ViT has a [CLS] token
    assert convnext.layers[0].router.pool == "mean"  # ConvNeXt has none
    assert convnext.layers[0].channels_dim == -1  # ConvNeXt-T's block MLP runs channels-last


def test_layers_are_in_network_order_whatever_the_group_order():
    spec = make_spec(TINY_CONVNEXT, [{"where": {"stage_last": 1}, "experts": 2},
                                     {"where": {"blocks": [0]}, "experts": 2}])
    paths = [layer.path for layer in moespec.plan(spec).layers]
    assert paths == ["stages.0.blocks.0.mlp", "stages.3.blocks.0.mlp"]  # depths (1, 1, 2, 1): 5 blocks


def test_rescale_plans_the_rebuilt_shape_of_a_mixer_block():
    mixer = {"model": "mixer_s16_224", "kwargs": {"num_blocks": 2, "img_size": 64, "num_classes": 10}}
    spec = make_spec(mixer, [{"where": {"last": 1}, "sublayer": "mlp_channels", "experts": 2}],
                     rescale={"where": {"last": 1}, "tokens": 2.0, "channels": 0.5})
    plan = moespec.plan(spec)
    (rescale,) = plan.rescales
    # 64 px / 16 = 4 x 4 = 16 patches; Mixer-S width 512; token MLP hidden 0.5 * 512 = 256, channel 4 * 512
    assert (rescale.block, rescale.tokens, rescale.channels) == ("blocks.1", 16, 512)
    assert (rescale.rescaled_tokens, rescale.rescaled_channels) == (32, 256)
    assert (rescale.token_hidden, rescale.channel_hidden) == (256, 2048)
    assert plan.layers[0].in_features == 256  # the channel MoE works at the rescaled width C1
    assert plan.rebuilt("blocks.1.mlp_channels") == rescale and plan.rebuilt("blocks.0.mlp_channels") is None
    assert "rescale blocks.1: [16, 512] -> [32, 256]" in plan.summary()


def test_rows_summary_and_text():
    plan = moespec.plan(make_spec(TINY_VIT, [{"where": {"last": 1}, "experts": 4,
                                              "router": {"kind": "topk", "top_k": 2, "normalize": True}}]))
    assert plan.rows() == [("blocks.1.mlp", "Mlp", "384", "1536", "1536", "4", "2", "0", "topk/linear norm")]
    assert plan.summary().startswith("test: vit_small_patch16_224, input [3, 64, 64], 2 blocks (blocks.0 .. blocks.1)")
    assert str(plan).splitlines()[1].split() == list(" ".join(Plan.COLUMNS).split())
    assert plan.input_size == tuple(TINY_INPUT)


def test_plan_for_an_already_built_model_equals_plan():
    spec = make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 2}])
    assert plan_for(spec, create_backbone(spec)) == moespec.plan(spec)


def test_mistakes_found_against_the_model_are_located_problems():
    with pytest.raises(SpecError) as error:
        moespec.plan(make_spec(TINY_VIT, [{"where": {"blocks": [5]}, "experts": 2},
                                          {"where": {"last": 1}, "sublayer": "mlp_tokens", "experts": 2}]))
    problems = {p.path: p.message for p in error.value.problems}
    assert problems["moe.0.where"] == "block index 5 is out of range; valid: 0..1 or -2..-1"
    assert problems["moe.1.sublayer"].startswith("block blocks.1 has no FFN sublayer 'mlp_tokens'; it has: mlp")


def _paths(model: str, **group) -> list[str]:
    spec = moespec.load_spec({"name": "x", "backbone": {"model": model},
                              "moe": [{"where": {"last": 1}, "experts": 4, **group}]})
    return [layer.path for layer in moespec.plan(spec).layers]


def test_a_group_without_sublayer_takes_every_residual_ffn_of_its_blocks():
    """MaxViT's blocks have two FFNs (after the block attention and after the grid attention): both, and not
    the relative-position MLPs inside the attentions, which map 2 coordinates to a bias per head. CoaT's FFN is
    called mlp2; Mixer's two are the token and the channel FFN."""
    block = "stages.3.blocks.1"
    assert _paths("maxvit_rmlp_pico_rw_256") == [f"{block}.attn_block.mlp", f"{block}.attn_grid.mlp"]
    assert _paths("maxvit_rmlp_pico_rw_256", sublayer="attn_grid.mlp") == [f"{block}.attn_grid.mlp"]
    assert _paths("coat_tiny") == ["parallel_blocks.5.mlp2"]
    assert _paths("mixer_s32_224") == ["blocks.7.mlp_tokens", "blocks.7.mlp_channels"]


BAD_TOP_K_AND_NAME = """\
backbone: {model: vit_smal_patch16_224, kwargs: {depth: 2, img_size: 64}}
input_size: [3, 64, 64]
moe:
  - where: {every: 1}
    experts: 4
    router: {top_k: 0}
"""

FIVE_PROBLEMS = """\
backbone: {model: vit_smal_patch16_224, kwargs: {depth: 2, img_size: 64}}
input_size: [3, 64]
upcycle: {noise: -1}
aux_loss_backward_scale: 0
moe:
  - where: {every: 1}
    experts: 4
    router: {top_k: 0}
"""


@pytest.mark.parametrize("text,count", [(BAD_TOP_K_AND_NAME, 2), (FIVE_PROBLEMS, 5)], ids=["two", "five"])
def test_validate_reports_the_fields_and_the_timm_model_name_at_once(text, count, tmp_path):
    """`moespec validate` of a file with a bad field and a misspelled model reports both in one run (the name,
    which only timm can check, came after the other problems were fixed), each at its line."""
    from typer.testing import CliRunner

    from moespec.cli import app
    from moespec.planning import plan_file

    path = write(tmp_path, text)
    with pytest.raises(SpecError) as caught:
        plan_file(path)
    problems = caught.value.problems
    assert len(problems) == count, problems
    (name,) = [p for p in problems if p.path == "backbone.model"]
    assert (name.line, name.file) == (1, str(path))
    assert "did you mean 'vit_small_patch16_224'" in name.message
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    assert result.stderr.count("moespec: error: ") == count and "unknown timm model" in result.stderr

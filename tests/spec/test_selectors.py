"""Selectors resolved against real timm block layouts (built on the meta device by `moespec.plan`)."""

from __future__ import annotations

from pathlib import Path

import pytest

import moespec
from moespec import SpecError, load_spec

from ..conftest import line_of, write

EXAMPLE = Path(__file__).parent.parent / "data" / "example_spec.yaml"

VIT = "vit_small_patch16_224"  # 12 blocks `blocks.i`, one stage
CONVNEXT = "convnext_tiny"  # stages of 3, 3, 9, 3 blocks at `stages.s.blocks.b`
CONVNEXT_BLOCKS = [f"stages.{s}.blocks.{b}" for s, n in enumerate((3, 3, 9, 3)) for b in range(n)]


def group_spec(model: str, where: str, extra: str = "") -> str:
    """A spec with one surgery group on `model`; `where:` is on line 4."""
    return f"""\
backbone:
  model: {model}
moe:
  - where: {where}
    experts: 4
{extra}"""


def plan_of(tmp_path: Path, text: str) -> moespec.Plan:
    return moespec.plan(load_spec(write(tmp_path, text)))


def paths(tmp_path: Path, model: str, where: str) -> list[str]:
    return [layer.path for layer in plan_of(tmp_path, group_spec(model, where)).layers]


def plan_problems(tmp_path: Path, text: str) -> tuple[Path, list[moespec.errors.Problem]]:
    path = write(tmp_path, text)
    spec = load_spec(path)
    with pytest.raises(SpecError) as info:
        moespec.plan(spec)
    return path, info.value.problems


def plan_problem(tmp_path: Path, text: str) -> tuple[Path, moespec.errors.Problem]:
    path, problems = plan_problems(tmp_path, text)
    assert len(problems) == 1, [str(p) for p in problems]
    return path, problems[0]


# --- layouts ------------------------------------------------------------------------------------------------


def test_vit_layout(tmp_path):
    layout = plan_of(tmp_path, group_spec(VIT, "{last: 1}")).layout
    assert [b.path for b in layout.blocks] == [f"blocks.{i}" for i in range(12)]
    assert layout.stages == (tuple(range(12)),)
    assert all(b.sublayers == ("mlp",) for b in layout.blocks)


def test_convnext_layout(tmp_path):
    layout = plan_of(tmp_path, group_spec(CONVNEXT, "{stage_last: 1}")).layout
    assert [b.path for b in layout.blocks] == CONVNEXT_BLOCKS
    assert [len(stage) for stage in layout.stages] == [3, 3, 9, 3]
    assert layout.stages[2] == tuple(range(6, 15))
    assert [b.stage for b in layout.blocks] == [0] * 3 + [1] * 3 + [2] * 9 + [3] * 3


# --- ViT selectors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "blocks"),
    [
        ("{every: 2}", [1, 3, 5, 7, 9, 11]),
        ("{every: 3}", [2, 5, 8, 11]),
        ("{every: 1}", list(range(12))),
        ("{last: 2}", [10, 11]),
        ("{last: 12}", list(range(12))),
        ("{first: 3}", [0, 1, 2]),
        ("{blocks: [0, -1]}", [0, 11]),
        ("{blocks: [-1, 0, 5]}", [0, 5, 11]),
        ("[{first: 2}, {blocks: [1, 5, -1]}, {last: 1}]", [0, 1, 5, 11]),
        ("[{every: 4}, {every: 6}]", [3, 5, 7, 11]),
    ],
)
def test_vit_selectors(tmp_path, where, blocks):
    assert paths(tmp_path, VIT, where) == [f"blocks.{i}.mlp" for i in blocks]


def test_vit_layer_plans_record_group_and_block(tmp_path):
    layers = plan_of(tmp_path, group_spec(VIT, "{blocks: [-1, 0]}")).layers
    assert [(layer.path, layer.block, layer.group) for layer in layers] == [("blocks.0.mlp", 0, 0),
                                                                             ("blocks.11.mlp", 11, 0)]


def test_example_spec_plans_every_second_block():
    plan = moespec.plan(load_spec(EXAMPLE))
    assert [layer.path for layer in plan.layers] == [f"blocks.{i}.mlp" for i in (1, 3, 5, 7, 9, 11)]
    assert {(layer.num_experts, layer.router.top_k, layer.shared_experts) for layer in plan.layers} == {(8, 2, 0)}
    assert plan.input_size == (3, 224, 224)


def test_two_groups_are_planned_in_network_order(tmp_path):
    text = f"""\
backbone: {{model: {VIT}}}
moe:
  - where: {{last: 1}}
    experts: 4
  - where: {{first: 1}}
    experts: 2
    top_k: 2
"""
    layers = plan_of(tmp_path, text).layers
    assert [(layer.path, layer.group, layer.num_experts, layer.router.top_k) for layer in layers] == [
        ("blocks.0.mlp", 1, 2, 2),
        ("blocks.11.mlp", 0, 4, 1),
    ]


# --- ConvNeXt selectors -------------------------------------------------------------------------------------


def test_convnext_stage_last_2(tmp_path):
    plan = plan_of(tmp_path, group_spec(CONVNEXT, "{stage_last: 2}"))
    assert [layer.path for layer in plan.layers] == ["stages.2.blocks.8.mlp", "stages.3.blocks.2.mlp"]
    assert [layer.block for layer in plan.layers] == [14, 17]


def test_convnext_stage_every_counts_within_each_stage(tmp_path):
    """The sweet-spot study's ConvNeXt-T "Every 2": every second block of each stage (3, 3, 9, 3 blocks), 7
    layers; `{every: 2}` counts across stages and picks 9."""
    assert paths(tmp_path, CONVNEXT, "{stage_every: 2}") == [
        "stages.0.blocks.1.mlp", "stages.1.blocks.1.mlp", "stages.2.blocks.1.mlp", "stages.2.blocks.3.mlp",
        "stages.2.blocks.5.mlp", "stages.2.blocks.7.mlp", "stages.3.blocks.1.mlp",
    ]
    assert paths(tmp_path, CONVNEXT, "{stage_every: 3}") == [
        "stages.0.blocks.2.mlp", "stages.1.blocks.2.mlp", "stages.2.blocks.2.mlp", "stages.2.blocks.5.mlp",
        "stages.2.blocks.8.mlp", "stages.3.blocks.2.mlp",
    ]
    assert len(paths(tmp_path, CONVNEXT, "{every: 2}")) == 9


def test_stage_every_on_one_stage_is_every(tmp_path):
    assert paths(tmp_path, VIT, "{stage_every: 2}") == paths(tmp_path, VIT, "{every: 2}")


def test_stage_every_longer_than_every_stage_matches_nothing(tmp_path):
    path, problem = plan_problem(tmp_path, group_spec(CONVNEXT, "{stage_every: 10}"))
    assert "matches no block" in problem.message and "stage" in problem.message


def test_convnext_stage_last_all(tmp_path):
    assert paths(tmp_path, CONVNEXT, "{stage_last: all}") == [
        "stages.0.blocks.2.mlp", "stages.1.blocks.2.mlp", "stages.2.blocks.8.mlp", "stages.3.blocks.2.mlp",
    ]


def test_convnext_per_stage_blocks(tmp_path):
    assert paths(tmp_path, CONVNEXT, "{stages: {2: [4, -1], 3: [-1]}}") == [
        "stages.2.blocks.4.mlp", "stages.2.blocks.8.mlp", "stages.3.blocks.2.mlp",
    ]


def test_convnext_negative_stage_index(tmp_path):
    assert paths(tmp_path, CONVNEXT, "{stages: {-1: [0], 0: [-3]}}") == ["stages.0.blocks.0.mlp",
                                                                          "stages.3.blocks.0.mlp"]


def test_convnext_every_2_numbers_blocks_globally(tmp_path):
    expected = [CONVNEXT_BLOCKS[i] + ".mlp" for i in range(1, 18, 2)]
    assert expected == [
        "stages.0.blocks.1.mlp", "stages.1.blocks.0.mlp", "stages.1.blocks.2.mlp", "stages.2.blocks.1.mlp",
        "stages.2.blocks.3.mlp", "stages.2.blocks.5.mlp", "stages.2.blocks.7.mlp", "stages.3.blocks.0.mlp",
        "stages.3.blocks.2.mlp",
    ]
    assert paths(tmp_path, CONVNEXT, "{every: 2}") == expected


def test_convnext_last_and_blocks_span_stages(tmp_path):
    assert paths(tmp_path, CONVNEXT, "{last: 4}") == [
        "stages.2.blocks.8.mlp", "stages.3.blocks.0.mlp", "stages.3.blocks.1.mlp", "stages.3.blocks.2.mlp",
    ]
    assert paths(tmp_path, CONVNEXT, "{blocks: [3, 6]}") == ["stages.1.blocks.0.mlp", "stages.2.blocks.0.mlp"]


def test_convnext_union_of_overlapping_selectors(tmp_path):
    assert paths(tmp_path, CONVNEXT, "[{stage_last: 2}, {last: 1}, {stages: {2: [-1]}}]") == [
        "stages.2.blocks.8.mlp", "stages.3.blocks.2.mlp",
    ]


# --- widths -------------------------------------------------------------------------------------------------


def test_convnext_expert_mlp_ratio_widths(tmp_path):
    plan = plan_of(tmp_path, group_spec(CONVNEXT, "{stage_last: 2}", "    expert_mlp_ratio: 2.0\n"))
    widths = [(layer.path, layer.in_features, layer.dense_hidden, layer.expert_hidden, layer.out_features)
              for layer in plan.layers]
    assert widths == [
        ("stages.2.blocks.8.mlp", 384, 1536, 768, 384),
        ("stages.3.blocks.2.mlp", 768, 3072, 1536, 768),
    ]


def test_convnext_default_width_is_the_dense_width(tmp_path):
    plan = plan_of(tmp_path, group_spec(CONVNEXT, "{stage_last: all}"))
    assert [(layer.in_features, layer.dense_hidden, layer.expert_hidden) for layer in plan.layers] == [
        (96, 384, 384), (192, 768, 768), (384, 1536, 1536), (768, 3072, 3072),
    ]


def test_vit_default_expert_hidden(tmp_path):
    plan = plan_of(tmp_path, group_spec(VIT, "{every: 2}"))
    widths = {(layer.in_features, layer.dense_hidden, layer.expert_hidden, layer.out_features) for layer in plan.layers}
    assert widths == {
        (384, 1536, 1536, 384)
    }
    assert {layer.family for layer in plan.layers} == {"Mlp"}


def test_vit_explicit_expert_hidden(tmp_path):
    plan = plan_of(tmp_path, group_spec(VIT, "{last: 1}", "    expert_hidden: 384\n"))
    assert [(layer.dense_hidden, layer.expert_hidden) for layer in plan.layers] == [(1536, 384)]


# --- errors -------------------------------------------------------------------------------------------------


def assert_where_problem(path: Path, problem, text: str, group: int = 0) -> None:
    assert problem.path == f"moe.{group}.where"
    assert problem.file == str(path)
    assert problem.line == line_of(text, "where:", nth=group)


def test_block_index_out_of_range(tmp_path):
    text = group_spec(VIT, "{blocks: [0, 12]}")
    path, problem = plan_problem(tmp_path, text)
    assert_where_problem(path, problem, text)
    assert "12" in problem.message
    assert "0..11" in problem.message and "-12..-1" in problem.message


def test_last_more_than_blocks(tmp_path):
    text = group_spec(VIT, "{last: 13}")
    path, problem = plan_problem(tmp_path, text)
    assert_where_problem(path, problem, text)
    assert problem.message == "last: 13 asks for more blocks than the model has (12); use 1..12"


def test_first_more_than_blocks(tmp_path):
    text = group_spec(CONVNEXT, "{first: 19}")
    path, problem = plan_problem(tmp_path, text)
    assert_where_problem(path, problem, text)
    assert problem.message == "first: 19 asks for more blocks than the model has (18); use 1..18"


@pytest.mark.parametrize("where, blocks", [("{stage_last: 1}", [11]), ("{stage_last: all}", [11]),
                                           ("{stages: {0: [1, -1]}}", [1, 11]),
                                           ("{stage_every: 4}", [3, 7, 11])])
def test_stage_selectors_see_the_one_stage_of_a_vit(tmp_path, where, blocks):
    """One rule for every stage selector on a single-stage model (issue 52: `validate` took `{stage_every: 2}`
    on a ViT but refused `{stage_last: 1}`): the model is one stage of 12 blocks."""
    plan = moespec.plan(load_spec(write(tmp_path, group_spec(VIT, where))))
    assert [layer.path for layer in plan.layers] == [f"blocks.{i}.mlp" for i in blocks]


@pytest.mark.parametrize("where, message", [
    ("{stage_last: 2}", "stage_last: 2 asks for more stages than the model has (1); use 1..1 or all"),
    ("{stages: {1: [0]}}", "stage index 1 is out of range; valid: 0..0 or -1..-1"),
])
def test_a_second_stage_of_a_vit_is_out_of_range(tmp_path, where, message):
    text = group_spec(VIT, where)
    path, problem = plan_problem(tmp_path, text)
    assert_where_problem(path, problem, text)
    assert problem.message == message


def test_stage_index_out_of_range(tmp_path):
    text = group_spec(CONVNEXT, "{stages: {4: [0]}}")
    path, problem = plan_problem(tmp_path, text)
    assert_where_problem(path, problem, text)
    assert problem.message == "stage index 4 is out of range; valid: 0..3 or -4..-1"


def test_block_index_in_stage_out_of_range(tmp_path):
    text = group_spec(CONVNEXT, "{stages: {1: [3]}}")
    path, problem = plan_problem(tmp_path, text)
    assert_where_problem(path, problem, text)
    assert problem.message == "stage 1 block index 3 is out of range; valid: 0..2 or -3..-1"


def test_stage_last_more_than_stages(tmp_path):
    text = group_spec(CONVNEXT, "{stage_last: 5}")
    path, problem = plan_problem(tmp_path, text)
    assert_where_problem(path, problem, text)
    assert problem.message == "stage_last: 5 asks for more stages than the model has (4); use 1..4 or all"


def test_selector_matching_no_block(tmp_path):
    text = group_spec(VIT, "{every: 13}")
    path, problem = plan_problem(tmp_path, text)
    assert_where_problem(path, problem, text)
    assert problem.message.startswith("matches no block; the model has 12 blocks (blocks.0 .. blocks.11)")


def test_unknown_selector_key_lists_the_forms(tmp_path):
    text = group_spec(VIT, "{evry: 2}")
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    problem = info.value.problems[0]
    assert_where_problem(path, problem, text)
    for form in ("{every: N}", "{last: N}", "{first: N}", "{blocks: [i, ...]}", "{stage_last: N | all}",
                 "{stages: {stage: [i, ...]}}", "{stage_every: N}"):
        assert form in problem.message
    assert problem.message.endswith("did you mean 'every'?")


@pytest.mark.parametrize(
    ("where", "problem_path"),
    [("{evry: 2}", "moe.0.where"), ("{every: 0}", "moe.0.where.every"), ("{every: 2, last: 1}", "moe.0.where")],
)
def test_bad_selector_is_one_problem(tmp_path, where, problem_path):
    """`where` is a selector or a list of them; a bad selector mapping must not also be reported as
    "input should be a valid list"."""
    path = write(tmp_path, group_spec(VIT, where))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert [p.path for p in info.value.problems] == [problem_path], [str(p) for p in info.value.problems]


def test_missing_sublayer(tmp_path):
    text = group_spec(VIT, "{every: 2}", "    sublayer: attn\n")
    path, problem = plan_problem(tmp_path, text)
    assert (problem.file, problem.line, problem.path) == (str(path), line_of(text, "sublayer"), "moe.0.sublayer")
    assert "'attn'" in problem.message
    assert problem.message.endswith("it has: mlp")


def test_two_groups_selecting_the_same_block(tmp_path):
    text = f"""\
backbone: {{model: {VIT}}}
moe:
  - where: {{every: 2}}
    experts: 8
  - where: {{last: 2}}
    experts: 4
"""
    path, problem = plan_problem(tmp_path, text)
    assert_where_problem(path, problem, text, group=1)
    assert problem.message == "blocks.11.mlp is already an MoE layer from moe.0; each FFN can be replaced once"


def test_unknown_timm_model(tmp_path):
    text = """\
backbone:
  model: vit_smal_patch16_224
moe: []
"""
    path, problem = plan_problem(tmp_path, text)
    assert (problem.file, problem.line, problem.path) == (str(path), 2, "backbone.model")
    assert problem.message == "unknown timm model 'vit_smal_patch16_224'; did you mean 'vit_small_patch16_224'?"


def test_kwargs_rejected_by_timm(tmp_path):
    text = f"""\
backbone:
  model: {VIT}
  kwargs: {{no_such_kwarg: 1}}
"""
    path, problem = plan_problem(tmp_path, text)
    assert (problem.file, problem.line, problem.path) == (str(path), 3, "backbone.kwargs")
    assert "no_such_kwarg" in problem.message


def test_backbone_without_known_ffn_is_located_in_the_spec(tmp_path):
    text = """\
backbone:
  model: resnet18
moe: []
"""
    path, problem = plan_problem(tmp_path, text)
    assert problem.path == "backbone.model"
    assert problem.message.startswith("this model has no FFN sublayer; MoE surgery needs one")
    # like every other plan error, it names the spec file and the line of backbone.model
    assert (problem.file, problem.line) == (str(path), 2)


def test_non_integer_expert_width(tmp_path):
    text = group_spec(CONVNEXT, "{stage_last: 2}", "    expert_mlp_ratio: 0.3\n")
    path, problems = plan_problems(tmp_path, text)
    line = line_of(text, "expert_mlp_ratio")
    assert [(p.file, p.line, p.path) for p in problems] == [(str(path), line, "moe.0.expert_mlp_ratio")] * 2
    assert "0.3 x 384" in problems[0].message and "115.2" in problems[0].message
    assert "stages.2.blocks.8.mlp" in problems[0].message
    assert "0.3 x 768" in problems[1].message and "230.4" in problems[1].message
    assert "expert_hidden" in problems[1].message


def test_selector_and_width_problems_are_reported_together(tmp_path):
    text = f"""\
backbone: {{model: {CONVNEXT}}}
moe:
  - where: {{stage_last: 5}}
    experts: 4
  - where: {{last: 1}}
    experts: 4
    expert_mlp_ratio: 0.3
"""
    path, problems = plan_problems(tmp_path, text)
    assert [(p.line, p.path) for p in problems] == [(3, "moe.0.where"), (7, "moe.1.expert_mlp_ratio")]

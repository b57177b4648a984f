"""Spec validation: defaults, and every error located at its file, line and field path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

import moespec
from moespec import Spec, SpecError, load_spec
from moespec.routers import Gate
from moespec.routers.topk import TopKRouterSpec as TopKRouter
from moespec.spec import AuxLoss, Upcycle
from moespec.spec.selectors import Blocks, Every, StageLast, Stages

from ..conftest import line_of, write

DATA = Path(__file__).parent.parent / "data"
EXAMPLE = DATA / "example_spec.yaml"

GROUP_KEYS = "where, sublayer, experts, expert_hidden, expert_mlp_ratio, shared_experts, router, aux_loss"


def column_of(text: str, needle: str) -> int:
    """1-based column of `needle` on the first line that contains it."""
    line = next(line for line in text.splitlines() if needle in line)
    return line.index(needle) + 1


def problems_of(path: Path) -> list[moespec.errors.Problem]:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return info.value.problems


def only_problem(path: Path) -> moespec.errors.Problem:
    problems = problems_of(path)
    assert len(problems) == 1, [str(p) for p in problems]
    return problems[0]


# --- valid specs and defaults -------------------------------------------------------------------------------


def test_example_spec_from_the_issue_validates_with_defaults():
    spec = load_spec(EXAMPLE)
    assert spec.name == "vit-s16-moe8-every2-top2"
    assert spec.source == str(EXAMPLE)
    assert spec.backbone.model == "vit_small_patch16_224"
    assert spec.backbone.kwargs == {"num_classes": 1000}
    assert spec.backbone.checkpoint is None
    assert spec.backbone.pretrained is False
    assert spec.input_size == (3, 224, 224)
    assert len(spec.moe) == 1
    group = spec.moe[0]
    assert group.where == [Every(every=2)]  # one selector is stored as a list of one
    assert group.sublayer == "mlp"
    assert (group.experts, group.router.top_k, group.shared_experts) == (8, 2, 0)
    assert group.expert_hidden is None and group.expert_mlp_ratio is None
    # the file is in release 0.1's form (top_k and capacity_factor on the group): they moved into the router
    assert group.router == TopKRouter(kind="topk", top_k=2, capacity_factor=None, gate=Gate(kind="linear"),
                                      normalize=False)
    assert group.aux_loss == [AuxLoss(kind="importance_load", weight=0.01)]
    assert spec.upcycle == Upcycle(router_init="normal", noise=0.0, split="slice")


def test_minimal_spec_gets_every_default(tmp_path):
    path = write(tmp_path, "{backbone: {model: vit_small_patch16_224}, moe: [{where: {every: 2}, experts: 8}]}\n",
                 name="my_spec.yaml")
    spec = load_spec(path)
    assert spec.name == "my_spec"
    assert spec.backbone.model == "vit_small_patch16_224"
    assert spec.backbone.kwargs == {}
    assert spec.backbone.checkpoint is None and spec.backbone.pretrained is False
    assert spec.input_size is None
    group, = spec.moe
    assert group.where == [Every(every=2)]  # one selector is stored as a list of one
    assert group.experts == 8
    assert group.router.top_k == 1
    assert group.sublayer is None  # every FFN of each picked block
    assert group.router.kind == "topk"
    assert group.router.gate == Gate(kind="linear", dim=None, temperature=None)
    assert group.router.normalize is False
    assert group.router.capacity_factor is None
    assert group.shared_experts == 0
    assert group.expert_hidden is None
    assert group.expert_mlp_ratio is None
    assert group.aux_loss == [AuxLoss(kind="importance_load", weight=0.01)]
    assert spec.upcycle == Upcycle(router_init="normal", noise=0.0, split="slice")


def test_dense_spec_has_no_groups(tmp_path):
    spec = load_spec(write(tmp_path, "backbone: {model: convnext_tiny}\n", name="dense.yaml"))
    assert spec.name == "dense"
    assert spec.moe == []


def test_router_without_kind_is_topk(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
moe:
  - where: {last: 2}
    experts: 4
    router: {normalize: true}
"""
    router = load_spec(write(tmp_path, text)).moe[0].router
    assert isinstance(router, TopKRouter)
    assert (router.kind, router.gate.kind, router.normalize) == ("topk", "linear", True)


def test_selector_forms_parse_to_their_models(tmp_path):
    text = """\
backbone: {model: convnext_tiny}
moe:
  - where: [{stages: {2: [4, -1], 3: [-1]}}, {stage_last: all}, {blocks: [0, -1]}]
    experts: 4
"""
    where = load_spec(write(tmp_path, text)).moe[0].where
    assert where == [Stages(stages={2: [4, -1], 3: [-1]}), StageLast(stage_last="all"), Blocks(blocks=[0, -1])]


def test_load_spec_from_dict_has_no_source():
    spec = load_spec({"backbone": {"model": "vit_small_patch16_224"}, "moe": [{"where": {"last": 1}, "experts": 2}]})
    assert spec.source is None
    assert spec.name is None
    assert spec.moe[0].experts == 2


# --- errors: cross-field checks -----------------------------------------------------------------------------


def test_top_k_larger_than_experts(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
moe:
  - where: {every: 2}
    experts: 2
    top_k: 3
"""
    path = write(tmp_path, text)
    problem = only_problem(path)
    assert (problem.file, problem.line, problem.path) == (str(path), line_of(text, "top_k"), "moe.0.top_k")
    assert "top_k (3)" in problem.message
    assert "experts (2)" in problem.message


def test_expert_hidden_and_expert_mlp_ratio_together(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
moe:
  - where: {every: 2}
    experts: 8
    expert_hidden: 768
    expert_mlp_ratio: 2.0
"""
    path = write(tmp_path, text)
    problem = only_problem(path)
    assert (problem.file, problem.line, problem.path) == (str(path), line_of(text, "expert_mlp_ratio"),
                                                          "moe.0.expert_mlp_ratio")
    assert problem.message == "give expert_hidden or expert_mlp_ratio, not both"


@pytest.mark.parametrize("experts", ["-1", "-7"])
def test_experts_must_not_be_negative(tmp_path, experts):
    text = f"""\
backbone: {{model: vit_small_patch16_224}}
moe:
  - where: {{every: 2}}
    experts: {experts}
"""
    path = write(tmp_path, text)
    problem = only_problem(path)
    assert (problem.file, problem.line, problem.path) == (str(path), line_of(text, "experts:"), "moe.0.experts")
    assert problem.column == column_of(text, "experts:")
    assert problem.message == "input should be between 0 and 65536"
    assert str(problem) == f"{path}:4:5: moe.0.experts: input should be between 0 and 65536"


def test_zero_experts_only_in_rescaled_blocks(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
moe:
  - where: {every: 2}
    experts: 0
"""
    path = write(tmp_path, text)
    spec = load_spec(path)  # the schema allows 0; the plan knows which blocks are rebuilt
    with pytest.raises(SpecError) as info:
        moespec.plan(spec)
    problem = info.value.problems[0]
    assert (problem.line, problem.path) == (line_of(text, "experts:"), "moe.0.experts")
    assert "only in blocks rebuilt by rescale" in problem.message


# --- errors: unknown keys -----------------------------------------------------------------------------------


def test_unknown_top_level_key_near_miss(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
inputsize: [3, 224, 224]
"""
    path = write(tmp_path, text)
    problem = only_problem(path)
    assert (problem.file, problem.line, problem.path) == (str(path), line_of(text, "inputsize"), "inputsize")
    assert problem.message == (
        "unknown key 'inputsize'; allowed: name, backbone, input_size, rescale, moe, upcycle, aux_loss_in_backward, "
        "aux_loss_backward_scale; did you mean 'input_size'?"
    )


def test_unknown_top_level_key_without_near_miss_has_no_hint(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
colour: red
"""
    path = write(tmp_path, text)
    problem = only_problem(path)
    assert (problem.line, problem.path) == (2, "colour")
    assert problem.message == ("unknown key 'colour'; allowed: name, backbone, input_size, rescale, moe, upcycle, "
                               "aux_loss_in_backward, aux_loss_backward_scale")
    assert "did you mean" not in problem.message


def test_unknown_key_in_a_group_suggests_the_near_miss(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
moe:
  - where: {every: 2}
    exprts: 8
"""
    path = write(tmp_path, text)
    problems = {p.path: p for p in problems_of(path)}
    # the typo is both an unknown key and a missing required one
    assert set(problems) == {"moe.0.exprts", "moe.0.experts"}
    unknown = problems["moe.0.exprts"]
    assert (unknown.file, unknown.line) == (str(path), line_of(text, "exprts"))
    assert unknown.message == f"unknown key 'exprts'; allowed: {GROUP_KEYS}; did you mean 'experts'?"
    missing = problems["moe.0.experts"]
    assert (missing.file, missing.line) == (str(path), line_of(text, "- where"))
    assert missing.message == "this field is required"


def test_unknown_key_in_router(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
moe:
  - where: {every: 2}
    experts: 8
    router: {kind: topk, normalise: true}
"""
    path = write(tmp_path, text)
    problem = only_problem(path)
    assert (problem.file, problem.line, problem.path) == (str(path), line_of(text, "normalise"),
                                                          "moe.0.router.normalise")
    assert problem.column == column_of(text, "normalise")
    assert problem.message == ("unknown key 'normalise'; allowed: kind, top_k, gate, normalize, score, scale, "
                               "bias_balance, groups, eval_top_k, capacity_factor, capacity_multiple, group, noise, "
                               "bpr, drop_fraction, eval_capacity_factor; did you mean 'normalize'?")


def test_unknown_router_kind_names_the_kinds_without_internals(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
moe:
  - where: {every: 2}
    experts: 8
    router: {kind: token_choice}
"""
    path = write(tmp_path, text)
    problem = only_problem(path)
    assert (problem.line, problem.path) == (line_of(text, "router:"), "moe.0.router")
    assert "'token_choice'" in problem.message
    for kind in ("'topk'", "'expert_choice'", "'soft'", "'image'"):
        assert kind in problem.message
    # the message is for spec authors: it must not leak moespec's private function names
    assert "_router_kind" not in problem.message


def test_unknown_key_in_aux_loss_list_is_one_problem(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
moe:
  - where: {every: 2}
    experts: 8
    aux_loss: [{kind: switch, wieght: 1.0}]
"""
    path = write(tmp_path, text)
    problems = problems_of(path)
    unknown = [p for p in problems if p.path == "moe.0.aux_loss.0.wieght"]
    assert len(unknown) == 1
    assert unknown[0].line == line_of(text, "wieght")
    assert unknown[0].message == "unknown key 'wieght'; allowed: kind, weight; did you mean 'weight'?"
    # aux_loss may be a mapping or a list; the list branch's error is the only real one
    assert [str(p) for p in problems] == [str(unknown[0])]


# --- errors: types and YAML ---------------------------------------------------------------------------------


def test_wrong_type(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
moe:
  - where: {every: 2}
    experts: "eight"
"""
    path = write(tmp_path, text)
    problem = only_problem(path)
    assert (problem.file, problem.line, problem.path) == (str(path), line_of(text, "eight"), "moe.0.experts")
    assert "valid integer" in problem.message


def test_wrong_literal_lists_the_choices(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
upcycle: {split: slices}
"""
    path = write(tmp_path, text)
    problem = only_problem(path)
    assert (problem.line, problem.path) == (2, "upcycle.split")
    assert problem.message == "input should be 'slice' or 'partition'; did you mean 'slice'?"


def test_reserved_backbone_kwargs(tmp_path):
    text = """\
backbone:
  model: vit_small_patch16_224
  kwargs: {pretrained: true}
"""
    path = write(tmp_path, text)
    problem = only_problem(path)
    assert (problem.line, problem.path) == (line_of(text, "kwargs"), "backbone.kwargs")
    assert "backbone.pretrained" in problem.message


def test_yaml_syntax_error_reports_its_line(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
moe:
  - where: {every: 2}
    experts: 8: 9
"""
    path = write(tmp_path, text)
    problem = only_problem(path)
    assert (problem.file, problem.line, problem.path) == (str(path), line_of(text, "experts: 8: 9"), "")
    assert problem.message.startswith("invalid YAML: ")
    assert "mapping values are not allowed" in problem.message


def test_tab_indented_file_mentions_tabs(tmp_path):
    text = "backbone:\n\tmodel: vit_small_patch16_224\n"
    path = write(tmp_path, text)
    problem = only_problem(path)
    assert (problem.file, problem.line, problem.column, problem.path) == (str(path), 2, 1, "")
    assert problem.message.startswith("invalid YAML: ")
    assert "tabs" in problem.message  # e.g. "indent with spaces, YAML does not allow tabs"


def test_duplicate_key_names_the_key_and_both_lines(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
moe:
  - where: {every: 2}
    experts: 8
    experts: 4
"""
    path = write(tmp_path, text)
    problem = only_problem(path)
    first, second = line_of(text, "experts:"), line_of(text, "experts:", nth=1)
    assert (problem.file, problem.line, problem.path) == (str(path), second, "moe.0.experts")
    assert "'experts'" in problem.message
    assert f"line {first}" in problem.message


def test_duplicate_top_level_key(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
moe: []
backbone: {model: convnext_tiny}
"""
    path = write(tmp_path, text)
    problem = only_problem(path)
    assert (problem.line, problem.path) == (3, "backbone")
    assert problem.message == "duplicate key 'backbone' (first given at line 1); give each key once"


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_empty_file(tmp_path, text):
    path = write(tmp_path, text)
    problem = only_problem(path)
    assert (problem.file, problem.line, problem.path) == (str(path), 1, "")
    assert "empty file" in problem.message
    assert "backbone" in problem.message


def test_top_level_list(tmp_path):
    path = write(tmp_path, "- backbone: {model: vit_small_patch16_224}\n")
    problem = only_problem(path)
    assert (problem.file, problem.line, problem.path) == (str(path), 1, "")
    assert problem.message == "a spec is a YAML mapping with at least 'backbone', but this is a list"


def test_missing_backbone(tmp_path):
    text = """\
name: no-backbone
moe: []
"""
    path = write(tmp_path, text)
    problem = only_problem(path)
    assert (problem.file, problem.line, problem.path) == (str(path), 1, "backbone")
    assert problem.message == "this field is required"


def test_missing_spec_file(tmp_path):
    path = tmp_path / "absent.yaml"
    problem = only_problem(path)
    assert (problem.file, problem.line, problem.message) == (str(path), None, "no such spec file")
    problem = only_problem(tmp_path)
    assert problem.message == "no such spec file (it is a folder)"


def test_several_problems_are_all_reported(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
moe:
  - where: {every: 2}
    experts: -1
    bogus: 1
"""
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    problems = info.value.problems
    assert sorted((p.file, p.line, p.path) for p in problems) == [
        (str(path), line_of(text, "experts"), "moe.0.experts"),
        (str(path), line_of(text, "bogus"), "moe.0.bogus"),
    ]
    # the exception's text has one "file:line:col: path: message" line per problem
    assert str(info.value).splitlines() == [str(p) for p in problems]
    assert f"{path}:5:5: moe.0.bogus: unknown key 'bogus'" in str(info.value)


def test_problems_in_two_groups(tmp_path):
    text = """\
backbone: {model: vit_small_patch16_224}
moe:
  - where: {every: 2}
    experts: 4
    top_k: 8
  - where: {last: 1}
    experts: 2
    shared_experts: -1
"""
    path = write(tmp_path, text)
    problems = problems_of(path)
    assert sorted((p.line, p.path) for p in problems) == [
        (line_of(text, "top_k"), "moe.0.top_k"),
        (line_of(text, "shared_experts"), "moe.1.shared_experts"),
    ]


# --- to_yaml and paths --------------------------------------------------------------------------------------


COMPLEX = """\
name: complex
backbone: {model: convnext_tiny, kwargs: {drop_path_rate: 0.1}, checkpoint: weights/dense.pth}
moe:
  - where: [{stages: {2: [4, -1], 3: [-1]}}, {stage_last: all}]
    experts: 4
    expert_mlp_ratio: 2.0
    capacity_factor: 1.25
    shared_experts: 1
    router: {normalize: true}
    aux_loss: [{kind: switch, weight: 0.1}, {kind: importance_load}]
  - where: {blocks: [0, -1]}
    experts: 2
    top_k: 2
    expert_hidden: 96
upcycle: {router_init: zeros, noise: 0.5, split: partition}
"""


@pytest.mark.parametrize("which", ["example", "minimal", "complex"])
def test_to_yaml_round_trips(tmp_path, which):
    if which == "example":
        path = EXAMPLE
    elif which == "minimal":
        path = write(tmp_path, "backbone: {model: vit_small_patch16_224}\nmoe: [{where: {every: 2}, experts: 8}]\n",
                     name="my_spec.yaml")
    else:
        path = write(tmp_path, COMPLEX)
    spec = load_spec(path)
    text = spec.to_yaml()
    again = load_spec(tmp_path / "elsewhere.yaml", text=text)
    assert again.model_dump() == spec.model_dump()
    assert again.source == str(tmp_path / "elsewhere.yaml")
    # every default is written out, and the file-derived name is kept
    data = yaml.safe_load(text)
    assert data["name"] == spec.name
    assert set(data) == {"name", "backbone", "input_size", "rescale", "moe", "upcycle", "aux_loss_in_backward",
                         "aux_loss_backward_scale"}
    assert set(data["moe"][0]) == set(GROUP_KEYS.split(", "))


def test_to_yaml_keeps_the_stem_name(tmp_path):
    spec = load_spec(write(tmp_path, "backbone: {model: vit_small_patch16_224}\n", name="my_spec.yaml"))
    again = load_spec(tmp_path / "renamed.yaml", text=spec.to_yaml())
    assert again.name == "my_spec"


def test_resolve_path_is_relative_to_the_spec_folder(tmp_path):
    folder = tmp_path / "specs" / "sub"
    folder.mkdir(parents=True)
    spec = load_spec(write(folder, COMPLEX))
    assert spec.resolve_path("ckpt.pth") == folder / "ckpt.pth"
    assert spec.resolve_path(spec.backbone.checkpoint) == folder / "weights" / "dense.pth"
    assert spec.resolve_path(tmp_path / "abs.pth") == tmp_path / "abs.pth"
    assert spec.resolve_path("~/x.pth") == Path.home() / "x.pth"


def test_resolve_path_without_a_file_is_unchanged():
    spec = load_spec({"backbone": {"model": "vit_small_patch16_224"}})
    assert spec.resolve_path("ckpt.pth") == Path("ckpt.pth")


def test_spec_is_frozen():
    spec = load_spec(EXAMPLE)
    with pytest.raises(ValidationError):
        spec.name = "other"  # type: ignore[misc]
    assert spec.name == "vit-s16-moe8-every2-top2"
    assert isinstance(spec, Spec)


MERGED = """\
backbone: {model: vit_small_patch16_224}
moe:
  - &first
    where: {first: 1}
    experts: 4
    router: {top_k: 2}
  - <<: *first
    where: {last: 1}
    experts: EXPERTS
"""


def test_a_merge_key_may_be_overridden(tmp_path):
    """YAML's merge key (`<<: *first`) followed by an override of a merged key is legal YAML; it was refused as
    "duplicate key 'where' ... give each key once"."""
    spec = load_spec(write(tmp_path, MERGED.replace("EXPERTS", "8")))
    assert spec.moe[1].where == [moespec.spec.selectors.Last(last=1)]
    assert (spec.moe[1].experts, spec.moe[1].router.top_k) == (8, 2)


def test_errors_in_a_merged_mapping_point_at_the_key_that_holds_the_value(tmp_path):
    """An overriding key's error is at the override; a merged key's at the mapping it came from."""
    text = MERGED.replace("EXPERTS", "100000").replace("top_k: 2", "top_k: 0")
    with pytest.raises(SpecError) as error:
        load_spec(write(tmp_path, text))
    found = {(p.path, p.line) for p in error.value.problems}
    assert found == {("moe.0.router.top_k", line_of(text, "top_k")), ("moe.1.router.top_k", line_of(text, "top_k")),
                     ("moe.1.experts", line_of(text, "experts: 100000"))}


def test_a_key_given_twice_beside_a_merge_key_is_still_a_duplicate(tmp_path):
    text = MERGED.replace("EXPERTS", "8") + "    where: {every: 1}\n"
    problem = only_problem(write(tmp_path, text))
    assert (problem.line, problem.path) == (line_of(text, "where: {every: 1}"), "moe.1.where")
    first = line_of(text, "last: 1")
    assert problem.message == f"duplicate key 'where' (first given at line {first}); give each key once"

"""Locating problems found after validation (against the real model) in the spec's file."""

from __future__ import annotations

import os

import pytest

from moespec import SpecError, load_spec
from moespec.spec import loading
from moespec.spec.loading import located, spec_problem

from ..conftest import line_of, write

TEXT = """\
backbone: {model: vit_small_patch16_224}
moe:
  - {where: {every: 2}, experts: 8, top_k: 2}
  - {where: {last: 1}, experts: 4}
"""

def _experts_at(line: int) -> tuple[int, int]:
    return line, TEXT.splitlines()[line - 1].index("experts") + 1


def test_a_spec_with_many_problems_is_parsed_once(tmp_path, monkeypatch):
    spec = load_spec(write(tmp_path, TEXT))
    parses = []
    monkeypatch.setattr(loading, "load_yaml", lambda *args: parses.append(args) or _real_load_yaml(*args))
    error = located(spec, SpecError([SpecError(f"problem {i}").problems[0] for i in range(3)]))
    problems = [spec_problem(spec, f"moe.{i % 2}.experts", f"problem {i}") for i in range(10)] + error.problems
    assert len(parses) == 1
    assert [(p.line, p.column) for p in problems[:2]] == [_experts_at(3), _experts_at(4)]
    assert str(problems[0]) == f"{spec.source}:3:{_experts_at(3)[1]}: moe.0.experts: problem 0"
    assert [(p.file, p.line) for p in error.problems] == [(spec.source, 1)] * 3  # no field path: the first line


def test_an_edited_file_is_parsed_again(tmp_path):
    path = write(tmp_path, TEXT)
    spec = load_spec(path)
    assert spec_problem(spec, "moe.1.experts", "x").line == line_of(TEXT, "experts: 4")
    edited = "# a comment line\n" + TEXT
    path.write_text(edited)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 1))  # also on a coarse clock
    assert spec_problem(spec, "moe.1.experts", "x").line == line_of(edited, "experts: 4")


def test_a_spec_without_a_readable_file_has_no_position(tmp_path):
    path = write(tmp_path, TEXT)
    spec = load_spec(path)
    path.unlink()
    problem = spec_problem(spec, "moe.0.experts", "x")
    assert (problem.file, problem.line, problem.column) == (str(path), None, None)
    path.write_text("moe: [unclosed\n")  # no longer YAML
    assert spec_problem(spec, "moe.0.experts", "x").line is None
    assert spec_problem(load_spec({"backbone": {"model": "vit_small_patch16_224"}}), "backbone", "x").file is None


_real_load_yaml = loading.load_yaml


def test_a_router_key_named_like_its_kind_is_reported_at_its_own_path(tmp_path):
    """`router: {kind: topk, topk: 2}`, the natural typo of top_k: pydantic's location names the union member
    (`topk`) and then the key (`topk`); the path names the key once, the allowed keys are the topk router's, and
    a second unknown key of the same router keeps its hint (issue 52: `moe.0.router.topk.topk: unknown key
    'topk'; allowed: ` with an empty list)."""
    text = ("name: typo\nbackbone: {model: vit_small_patch16_224, kwargs: {depth: 2, img_size: 64}}\n"
            "input_size: [3, 64, 64]\nmoe:\n  - where: {every: 2}\n    experts: 4\n"
            "    router: {kind: topk, topk: 2, scor: softmax}\n")
    with pytest.raises(SpecError) as error:
        load_spec(write(tmp_path, text))
    problems = {p.path: p for p in error.value.problems}
    assert set(problems) == {"moe.0.router.topk", "moe.0.router.scor"}
    topk, scor = problems["moe.0.router.topk"], problems["moe.0.router.scor"]
    assert topk.message.startswith("unknown key 'topk'; allowed: kind, top_k,")
    assert "did you mean 'top_k'" in topk.message
    assert "did you mean 'score'" in scor.message
    assert (topk.line, scor.line) == (line_of(text, "topk: 2"), line_of(text, "scor:"))


@pytest.mark.parametrize("router, where", [
    ("{kind: topk, top_k: 5, score: sigmod}", "top_k: 5"),
    ("{kind: topk, score: sigmod, groups: {count: 3, top: 1}}", "groups:"),
])
def test_a_cross_field_check_is_reported_with_the_value_errors_of_its_router(tmp_path, router, where):
    """A value error in a router (`score: sigmod`) kept pydantic from running the router's check against the
    group's experts, so `top_k: 5` over 4 experts went unreported until the typo was fixed (issue 52); both
    are reported at once, each at its own line."""
    text = ("name: both\nbackbone: {model: vit_small_patch16_224, kwargs: {depth: 2, img_size: 64}}\n"
            f"input_size: [3, 64, 64]\nmoe:\n  - where: {{every: 2}}\n    experts: 4\n    router: {router}\n")
    with pytest.raises(SpecError) as error:
        load_spec(write(tmp_path, text))
    problems = {p.path: p for p in error.value.problems}
    field = "top_k" if where == "top_k: 5" else "groups"
    assert set(problems) == {"moe.0.router.score", f"moe.0.router.{field}"}
    assert problems["moe.0.router.score"].message.endswith("did you mean 'sigmoid'?")
    assert problems[f"moe.0.router.{field}"].message == (
        "top_k (5) must be between 1 and experts (4)" if field == "top_k"
        else "groups.count (3) must divide experts (4) into equal groups")
    assert problems[f"moe.0.router.{field}"].line == line_of(text, "router:")
    assert problems[f"moe.0.router.{field}"].column == text.splitlines()[6].index(where) + 1


def test_a_router_valid_but_for_its_typo_and_its_experts_reports_only_the_typo(tmp_path):
    text = ("name: one\nbackbone: {model: vit_small_patch16_224, kwargs: {depth: 2, img_size: 64}}\n"
            "input_size: [3, 64, 64]\nmoe:\n  - where: {every: 2}\n    experts: 4\n"
            "    router: {kind: topk, top_k: 2, score: sigmod}\n")
    with pytest.raises(SpecError) as error:
        load_spec(write(tmp_path, text))
    assert [p.path for p in error.value.problems] == ["moe.0.router.score"]

"""Fuzzing: specs mutated from the shipped ones fail only as user errors, never as crashes.

Documents are the shipped specs with a few mutations at any depth: keys deleted, renamed (often to a
near-miss typo) or added; values replaced by a value of another type; numbers made negative, zero, huge,
infinite or fractional; strings replaced or misspelled. Raw YAML text is mutated too. The property:
`load_spec` raises nothing but `SpecError`, and `plan` of a spec that loads raises nothing but
`MoespecError`. Anything else is a bug in moespec.

The example budget comes from the hypothesis profile (registered in conftest.py): `ci` by default, `long`
with `MOESPEC_FUZZ=long` or `pytest --hypothesis-profile=long`.
"""

from __future__ import annotations

import copy
import math
import string
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import event, given
from hypothesis import strategies as st

from moespec import MoespecError, Spec, SpecError, load_spec, plan
from moespec.spec import ROUTER_KINDS

from ..conftest import SPECS_DIR

SHIPPED = [path.read_text(encoding="utf-8") for path in sorted(SPECS_DIR.glob("*.yaml"))]
DOCUMENTS = [yaml.safe_load(text) for text in SHIPPED]
PLANNED_NUMBER_LIMIT = 32  # larger numbers in backbone.kwargs (depth: 10**6) make timm build for minutes


def _schema_keys(node: Any) -> set[str]:
    """Every key of the spec language, from its JSON schema: the words a user misspells."""
    if isinstance(node, dict):
        keys = set(node["properties"]) if isinstance(node.get("properties"), dict) else set()
        return keys | {key for value in node.values() for key in _schema_keys(value)}
    if isinstance(node, list):
        return {key for value in node for key in _schema_keys(value)}
    return set()


KEYS = sorted(_schema_keys(Spec.model_json_schema()) | set(ROUTER_KINDS) | {"img_size", "depth", "num_classes"})

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.floats(), st.text(max_size=12),
    st.sampled_from([0, -1, 1, 2, 0.5, -0.5, 1e-12, 1e300, 2**63, math.inf, -math.inf, math.nan, "", "all"]),
)
# Pieces of valid specs, so that mutated documents still load often enough to reach `plan`.
FRAGMENTS = st.sampled_from([
    {"every": 3}, {"last": 100}, {"first": 1}, {"blocks": [0, -1]}, {"blocks": [-100]}, {"stage_last": "all"},
    {"stage_last": 2}, {"stages": {2: [0, -1]}}, {"stages": {9: [0]}}, {"stages": {0: [7]}},
    [{"last": 1}, {"first": 1}], {"kind": "soft", "slots_per_expert": 2}, {"kind": "expert_choice", "capacity": 2.0},
    {"kind": "image", "pool": "cls"}, {"kind": "topk", "gate": {"kind": "cosine", "dim": 8}},
    {"where": {"last": 1}, "tokens": 2.0, "channels": 0.5},
    {"where": {"last": 2}, "experts": 0}, {"where": {"every": 1}, "sublayer": "mlp_tokens", "experts": 2},
    "mlp", "mlp_tokens", "mlp_channels", "norm", "weights.pth", "absent.safetensors",
]).map(copy.deepcopy)  # mutations edit documents in place
values = st.recursive(
    st.one_of(scalars, FRAGMENTS),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6,
)


@st.composite
def typo(draw: st.DrawFn, word: str) -> str:
    """A near miss of `word`: one letter dropped, doubled, swapped, replaced, or the case changed."""
    if not word:
        return draw(st.text(string.ascii_lowercase, min_size=1, max_size=3))
    i = draw(st.integers(0, len(word) - 1))
    letter = draw(st.sampled_from(string.ascii_lowercase + "_"))
    return draw(st.sampled_from([
        word[:i] + word[i + 1:], word[:i] + word[i] + word[i:], word[:i] + word[i + 1:i + 2] + word[i] + word[i + 2:],
        word[:i] + letter + word[i + 1:], word.upper(), word + "s",
    ]))


def _slots(node: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every node of the document (keys of mappings, indices of lists), the root first."""
    found = [path]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _slots(value, path + (key,))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _slots(value, path + (index,))
    return found


def _get(doc: Any, path: tuple) -> Any:
    for part in path:
        doc = doc[part]
    return doc


@st.composite
def new_value(draw: st.DrawFn, old: Any) -> Any:
    """A value to put where `old` was: of another type, out of range, or a misspelling."""
    options = [values, nudged(old)]
    if isinstance(old, (int, float)) and not isinstance(old, bool):
        options.append(st.sampled_from([-old, 0, old + 1, old * 10**9, old / 3, -1, math.inf, math.nan]))
    if isinstance(old, str):
        options.append(typo(old))
    return draw(st.one_of(options))


def nudged(old: Any) -> st.SearchStrategy:
    """A plausible value of the same kind as `old`: the mutations that still load and reach `plan`."""
    if isinstance(old, bool):
        return st.booleans()
    if isinstance(old, int):
        return st.integers(-2, 16)
    if isinstance(old, float):
        return st.sampled_from([0.0, 0.3, 0.5, 1.0, 1.3, 2.0, 3.0])
    return FRAGMENTS


@st.composite
def mutate(draw: st.DrawFn, doc: dict) -> Any:
    """`doc` with one key-, type- or value-level change at a random node."""
    path = draw(st.sampled_from(_slots(doc)))
    if not path:
        return draw(st.one_of(values, st.just(doc)))  # the whole document
    parent, key = _get(doc, path[:-1]), path[-1]
    action = draw(st.sampled_from(["delete", "rename", "add", "replace", "nudge"]))
    if action == "delete":
        del parent[key]
    elif action == "rename" and isinstance(parent, dict):
        new_key = draw(st.one_of(typo(str(key)), st.sampled_from(KEYS), st.text(max_size=8), st.integers(-2, 2)))
        parent[new_key] = parent.pop(key)
    elif action == "add" and isinstance(parent, dict):
        parent[draw(st.one_of(st.sampled_from(KEYS).flatmap(typo), st.sampled_from(KEYS)))] = draw(values)
    elif action == "add":
        parent.insert(key, draw(values))
    elif action == "nudge":
        parent[key] = draw(nudged(parent[key]))
    else:  # replace, and a rename in a list
        parent[key] = draw(new_value(parent[key]))
    return doc


@st.composite
def mutated_document(draw: st.DrawFn) -> Any:
    doc: Any = copy.deepcopy(draw(st.sampled_from(DOCUMENTS)))
    for _ in range(draw(st.integers(1, 3))):
        if not isinstance(doc, (dict, list)):
            break
        doc = draw(mutate(doc))
    return doc


@st.composite
def mutated_text(draw: st.DrawFn) -> str:
    """A shipped spec file with a few characters inserted, deleted or replaced (YAML syntax, tabs, ...)."""
    text = draw(st.sampled_from(SHIPPED))
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 8)))
        insert = draw(st.one_of(st.sampled_from(list("\t\n :-[]{},'\"#&*!%@`|>?") + ["  ", "- ", ": "]),
                                st.text(max_size=4)))
        text = text[:i] + insert + text[j:]
    return text


def _plannable(doc: dict) -> bool:
    """Whether planning stays fast: timm builds what backbone.kwargs ask for, even on the meta device."""
    kwargs = doc.get("backbone", {}).get("kwargs") if isinstance(doc.get("backbone"), dict) else None
    return all(abs(n) <= PLANNED_NUMBER_LIMIT or n in (224, 1000)
               for n in _numbers(kwargs) if not math.isnan(n))


def _numbers(node: Any) -> list[float]:
    if isinstance(node, dict):
        return [n for value in node.values() for n in _numbers(value)]
    if isinstance(node, list):
        return [n for value in node for n in _numbers(value)]
    return [node] if isinstance(node, (int, float)) and not isinstance(node, bool) else []


def _check_problems(error: SpecError, file: str | None) -> None:
    """Each problem is one non-empty line (the CLI prints one per problem) that names the spec's file."""
    assert error.problems
    for problem in error.problems:
        assert problem.message and "\n" not in str(problem), str(problem)
        assert problem.file == file, str(problem)


def _load_and_plan(text: str, file: Path, planned: bool) -> None:
    """`load_spec` on `text` written to `file`, then `plan` if it loads and `planned`: user errors only."""
    file.write_text(text, encoding="utf-8")
    try:
        spec = load_spec(file)
    except SpecError as error:
        _check_problems(error, str(file))
        event("load_spec: SpecError")
        return
    if not planned:
        event("load_spec: ok, not planned")
        return
    try:
        plan(spec)
        event("plan: ok")
    except SpecError as error:
        _check_problems(error, str(file))
        event("plan: SpecError")
    except MoespecError:
        event("plan: MoespecError")


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "fuzz.yaml"


@pytest.mark.slow  # plans mutations of the real-size shipped specs (11 s): CI runs it
@given(doc=mutated_document())
def test_mutated_documents_fail_only_as_user_errors(doc, spec_file):
    _load_and_plan(yaml.safe_dump(doc, sort_keys=False), spec_file, isinstance(doc, dict) and _plannable(doc))


@pytest.mark.slow
@given(text=mutated_text())
def test_mutated_yaml_text_fails_only_as_user_errors(text, spec_file):
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        doc = None
    _load_and_plan(text, spec_file, isinstance(doc, dict) and _plannable(doc))


@given(doc=mutated_document())
def test_mutated_mappings_fail_only_as_spec_errors(doc):
    """`load_spec(dict)`: the same without a file (no positions)."""
    if isinstance(doc, dict):
        try:
            load_spec(doc)
        except SpecError as error:
            _check_problems(error, None)

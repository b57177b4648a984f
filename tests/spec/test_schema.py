"""The JSON Schema of spec files: the committed copy is what `moespec schema` prints, every shipped spec
passes it, and it accepts and rejects what the pydantic models accept and reject (the structural part)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from moespec.cli import app
from moespec.spec import SCHEMA_FILE, Spec, json_schema

from ..conftest import SPECS_DIR

SCHEMA_LINE = "# yaml-language-server: $schema=../moespec/spec.schema.json"
SPECS = sorted(SPECS_DIR.glob("*.yaml"))


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def as_json(document: dict) -> dict:
    """The document as an editor's language server sees it (JSON types: mapping keys are strings)."""
    return json.loads(json.dumps(document))


def test_committed_schema_is_what_moespec_schema_prints():
    result = CliRunner().invoke(app, ["schema"])
    assert result.exit_code == 0, result.output
    assert result.stdout == SCHEMA_FILE.read_text(encoding="utf-8"), (
        "moespec/spec.schema.json is stale; regenerate it with `moespec schema > moespec/spec.schema.json`")
    assert json.loads(result.stdout) == json_schema()


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_shipped_spec_points_at_the_schema_and_passes_it(path, validator):
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first == SCHEMA_LINE
    assert (path.parent / first.split("$schema=")[1]).resolve() == SCHEMA_FILE.resolve()
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator.iter_errors(as_json(yaml.safe_load(path.read_text(encoding="utf-8"))))]
    assert errors == []


def test_the_readme_example_passes_the_schema(validator):
    example = SPECS_DIR.parent / "tests" / "data" / "example_spec.yaml"
    assert validator.is_valid(as_json(yaml.safe_load(example.read_text(encoding="utf-8"))))


BACKBONE = {"model": "vit_small_patch16_224"}
ACCEPTED = {
    "no surgery": {},
    "one selector": {"moe": [{"where": {"every": 2}, "experts": 8}]},
    "a union of selectors": {"moe": [{"where": [{"every": 2}, {"last": 1}], "experts": 8, "top_k": 2}]},
    "stage selectors": {"moe": [{"where": [{"stages": {2: [4, -1]}}, {"stage_last": "all"}], "experts": 4}]},
    "router without kind": {"moe": [{"where": {"last": 2}, "experts": 4, "router": {"normalize": True}}]},
    "gate shorthand": {"moe": [{"where": {"last": 2}, "experts": 4, "router": {"kind": "image", "gate": "cosine"}}]},
    "gate mapping": {"moe": [{"where": {"last": 2}, "experts": 4,
                              "router": {"kind": "expert_choice", "gate": {"kind": "l2", "dim": 8}}}]},
    "soft router": {"moe": [{"where": {"last": 2}, "experts": 4, "router": {"kind": "soft", "slots_per_expert": 2}}]},
    "one aux loss": {"moe": [{"where": {"first": 1}, "experts": 4, "aux_loss": {"kind": "switch", "weight": 0.1}}]},
    "aux losses": {"moe": [{"where": {"first": 1}, "experts": 4,
                            "aux_loss": [{"kind": "switch"}, {"kind": "z_loss"}]}]},
    "router noise as std": {"moe": [{"where": {"blocks": [0, -1]}, "experts": 4, "router": {"noise": 0.5}}]},
    "one rescale": {"rescale": {"where": {"last": 2}, "tokens": 2.0, "channels": 0.5}},
    "aux loss in backward": {"aux_loss_in_backward": True},
}
REJECTED = {
    "unknown top-level key": {"moes": []},
    "unknown group key": {"moe": [{"where": {"every": 2}, "experts": 8, "exprts": 8}]},
    "missing experts": {"moe": [{"where": {"every": 2}}]},
    "unknown router kind": {"moe": [{"where": {"every": 2}, "experts": 8, "router": {"kind": "hash"}}]},
    "option of another router": {"moe": [{"where": {"every": 2}, "experts": 8,
                                          "router": {"kind": "soft", "bpr": True}}]},
    "unknown selector": {"moe": [{"where": {"evry": 2}, "experts": 8}]},
    "two keys in a selector": {"moe": [{"where": {"every": 2, "last": 1}, "experts": 8}]},
    "empty where": {"moe": [{"where": [], "experts": 8}]},
    "negative experts": {"moe": [{"where": {"every": 2}, "experts": -1}]},
    "experts as text": {"moe": [{"where": {"every": 2}, "experts": "8"}]},
    "experts as bool": {"moe": [{"where": {"every": 2}, "experts": True}]},
    "unknown gate": {"moe": [{"where": {"every": 2}, "experts": 8, "router": {"gate": "dot"}}]},
    "stage that is not a number": {"moe": [{"where": {"stages": {"two": [1]}}, "experts": 8}]},
    "input size of two numbers": {"input_size": [3, 224]},
    "drop fraction of 1": {"moe": [{"where": {"every": 2}, "experts": 8, "router": {"drop_fraction": 1.0}}]},
}


def pydantic_accepts(document: dict) -> bool:
    try:
        Spec.model_validate(document)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize("case", ACCEPTED)
def test_schema_accepts_what_the_spec_accepts(case, validator):
    document = {"backbone": BACKBONE, **ACCEPTED[case]}
    assert pydantic_accepts(document)
    assert validator.is_valid(as_json(document)), list(validator.iter_errors(as_json(document)))


@pytest.mark.parametrize("case", REJECTED)
def test_schema_rejects_what_the_spec_rejects(case, validator):
    document = {"backbone": BACKBONE, **REJECTED[case]}
    assert not pydantic_accepts(document)
    assert not validator.is_valid(as_json(document))


def test_schema_describes_fields_for_editors():
    defs = json_schema()["$defs"]
    assert "Routed experts E" in defs["MoEGroup"]["properties"]["experts"]["description"]
    assert defs["Every"]["description"].startswith("Every N-th block")
    assert [one["$ref"] for one in defs["MoEGroup"]["properties"]["router"]["oneOf"]] == [
        "#/$defs/TopKRouter", "#/$defs/ExpertChoiceRouter", "#/$defs/SoftRouter", "#/$defs/ImageRouter"]

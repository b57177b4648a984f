"""Every integer field of the spec has an upper bound, stated in its message and in the JSON Schema, so that
`experts: 10**30` is a located spec error, not a C++ overflow in torch (exit 1); so have the width factors."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from moespec import SpecError, load_spec
from moespec.cli import app

from ..conftest import TINY_SPEC_YAML, TINY_VIT


def problem_of(source):
    with pytest.raises(SpecError) as info:
        load_spec(source)
    assert len(info.value.problems) == 1, str(info.value)
    return info.value.problems[0]


def in_group(fields):
    """value -> a spec whose one surgery group has `fields(value)`."""
    return lambda value: {"backbone": TINY_VIT, "moe": [{"where": {"last": 1}, "experts": 4, **fields(value)}]}


BOUNDS = {  # field: (a spec with the value there, the lowest and the highest value allowed)
    "moe.0.experts": (in_group(lambda v: {"experts": v}), 0, 65_536),
    "moe.0.top_k": (in_group(lambda v: {"experts": 65_536, "top_k": v}), 1, 65_536),
    "moe.0.shared_experts": (in_group(lambda v: {"shared_experts": v}), 0, 65_536),
    "moe.0.expert_hidden": (in_group(lambda v: {"expert_hidden": v}), 1, 1_048_576),
    "moe.0.router.group": (in_group(lambda v: {"router": {"group": v}, "capacity_factor": 1.0}), 1, 1_048_576),
    "moe.0.router.gate.dim": (in_group(lambda v: {"router": {"gate": {"kind": "cosine", "dim": v}}}), 1, 65_536),
    "moe.0.router.slots_per_expert": (in_group(lambda v: {"router": {"kind": "soft", "slots_per_expert": v}}),
                                      1, 65_536),
    "moe.0.where.every": (in_group(lambda v: {"where": {"every": v}}), 1, 4_096),
    "moe.0.where.last": (in_group(lambda v: {"where": {"last": v}}), 1, 4_096),
    "moe.0.where.first": (in_group(lambda v: {"where": {"first": v}}), 1, 4_096),
    "moe.0.where.stage_last": (in_group(lambda v: {"where": {"stage_last": v}}), 1, 4_096),
    "moe.0.where.stage_every": (in_group(lambda v: {"where": {"stage_every": v}}), 1, 4_096),
    "moe.0.where.blocks.0": (in_group(lambda v: {"where": {"blocks": [v]}}), -4_096, 4_095),
    "moe.0.where.stages (a stage)": (in_group(lambda v: {"where": {"stages": {v: [0]}}}), -4_096, 4_095),
    "moe.0.where.stages.0.0": (in_group(lambda v: {"where": {"stages": {0: [v]}}}), -4_096, 4_095),
    "input_size.0": (lambda v: {"backbone": TINY_VIT, "input_size": [v, 64, 64]}, 1, 1_024),
    "input_size.2": (lambda v: {"backbone": TINY_VIT, "input_size": [3, 64, v]}, 1, 16_384),
}


@pytest.mark.parametrize("field", BOUNDS)
def test_every_integer_field_is_bounded_and_says_its_range(field):
    spec, low, high = BOUNDS[field]
    for inside in (low, high):
        load_spec(spec(inside))
    for outside in (low - 1, high + 1, 10**30):
        problem = problem_of(spec(outside))
        assert problem.path.startswith(field.split(" ")[0]) and f"between {low} and {high}" in problem.message, problem


@pytest.mark.parametrize("field", ["expert_mlp_ratio", "rescale.tokens", "rescale.channels"])
def test_width_factors_are_bounded(field):
    document = {"backbone": {"model": "mixer_s16_224"}, "rescale": {"where": {"last": 1}}}
    if field == "expert_mlp_ratio":
        document["moe"] = [{"where": {"last": 1}, "experts": 4, field: 1e30}]
    else:
        document["rescale"][field.split(".")[1]] = 1e30
    assert problem_of(document).message == "input should be less than or equal to 64"


def test_stats_of_a_huge_expert_count_is_one_located_line(tmp_path):
    """It was a C++ frame dump from torch.empty (exit 1)."""
    path = tmp_path / "huge.yaml"
    path.write_text(TINY_SPEC_YAML.replace("experts: 4", "experts: 1000000000000000000000000000000"), encoding="utf-8")
    result = CliRunner().invoke(app, ["stats", str(path)])
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == f"moespec: error: {path}:6:5: moe.0.experts: input should be between 0 and 65536\n"


def test_backbone_kwargs_integers_fit_int64():
    """timm passed them on to torch, which failed with a C++ frame dump as the message."""
    kwargs = {"img_size": [64, 2**63 - 1], "nested": {"low": -(2**63)}}
    assert load_spec({"backbone": {"model": "vit_small_patch16_224", "kwargs": kwargs}}).backbone.kwargs == kwargs
    for name, value in [("embed_dim", 10**30), ("img_size", [64, 2**63]), ("nested", {"low": -(2**63) - 1})]:
        problem = problem_of({"backbone": {"model": "vit_small_patch16_224", "kwargs": {name: value}}})
        assert problem.path == f"backbone.kwargs.{name}" and "does not fit torch's 64-bit integers" in problem.message


def _numbers(schema, path=()):
    """(path, schema) of every number in a JSON Schema, its `$defs` included."""
    if isinstance(schema, dict):
        if schema.get("type") == "number":
            yield path, schema
        for key, value in schema.items():
            yield from _numbers(value, (*path, key))
    elif isinstance(schema, list):
        for index, value in enumerate(schema):
            yield from _numbers(value, (*path, index))


def test_every_float_field_has_an_upper_bound_in_the_schema():
    """`capacity_factor: 1e308` validated, then `stats` and `upcycle` failed with "OverflowError: cannot convert
    float infinity to integer" (exit 1); every float field of the built-in kinds has a range now."""
    from moespec.spec.schema import json_schema

    numbers = list(_numbers(json_schema()))
    assert len(numbers) >= 10
    unbounded = [path for path, number in numbers if "maximum" not in number and "exclusiveMaximum" not in number]
    assert not unbounded


HUGE = 1e308
FLOATS = {  # field: a spec with the value there
    "moe.0.router.capacity_factor": in_group(lambda v: {"router": {"top_k": 2, "capacity_factor": v}}),
    "moe.0.router.noise": in_group(lambda v: {"router": {"noise": v}}),
    "moe.0.router.capacity": in_group(lambda v: {"router": {"kind": "expert_choice", "capacity": v}}),
    "moe.0.router.gate.temperature": in_group(lambda v: {"router": {"gate": {"kind": "cosine", "temperature": v}}}),
    "moe.0.router.scale": in_group(lambda v: {"router": {"scale": v}}),
    "moe.0.router.bias_balance.rate": in_group(lambda v: {"router": {"bias_balance": {"rate": v}}}),
    "moe.0.router.eval_capacity_factor": in_group(lambda v: {"router": {"eval_capacity_factor": v}}),
    "moe.0.aux_loss.weight": in_group(lambda v: {"aux_loss": {"weight": v}}),
    "upcycle.noise": lambda v: {"backbone": TINY_VIT, "upcycle": {"noise": v}},
    "aux_loss_backward_scale": lambda v: {"backbone": TINY_VIT, "aux_loss_backward_scale": v},
}


@pytest.mark.parametrize("field", FLOATS)
def test_a_huge_float_is_a_located_error(field):
    problem = problem_of(FLOATS[field](HUGE))
    assert problem.path == field and "less than or equal to" in problem.message, problem


def test_a_tiny_temperature_is_refused():
    """Cosine logits divided by 1e-300 are inf in float32, and the softmax of them NaN."""
    problem = problem_of(FLOATS["moe.0.router.gate.temperature"](1e-300))
    assert problem.message == "input should be greater than or equal to 0.001 or 'learnable'"


@pytest.mark.parametrize("command", ["stats", "upcycle"])
def test_stats_and_upcycle_of_a_huge_capacity_factor_are_one_located_line(tmp_path, command):
    """Both exited 1 with an OverflowError, and upcycle left its output file behind."""
    path = tmp_path / "huge.yaml"
    path.write_text(TINY_SPEC_YAML.replace("router: {top_k: 2}", "router: {top_k: 2, capacity_factor: 1e308}"),
                    encoding="utf-8")
    out = tmp_path / "out.safetensors"
    result = CliRunner().invoke(app, [command, str(path)] + (["-o", str(out)] if command == "upcycle" else []))
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (f"moespec: error: {path}:7:24: moe.0.router.capacity_factor: input should be less than "
                             f"or equal to 65536\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["huge.yaml"]


def test_the_largest_router_noise_trains_to_finite_outputs():
    """`noise: 1e308` validated, then a training forward raised ValueError in torch.distributions (the noisy
    logits were inf); at the bound the forward is finite."""
    import torch

    from moespec import create_model

    spec = load_spec({**in_group(lambda v: {"router": {"top_k": 2, "noise": v}})(100.0), "input_size": [3, 64, 64]})
    model = create_model(spec, seed=0).train()
    assert torch.isfinite(model(torch.randn(2, 3, 64, 64))).all()


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "[0.1, .nan]"])
def test_backbone_kwargs_floats_are_finite_and_refused_where_they_are(tmp_path, value):
    """`drop_rate: .nan` reached timm, and its refusal was reported at `input_size`."""
    path = tmp_path / "nan.yaml"
    text = TINY_SPEC_YAML.replace("num_classes: 10}", f"num_classes: 10, drop_rate: {value}}}")
    path.write_text(text, encoding="utf-8")
    result = CliRunner().invoke(app, ["validate", str(path)])
    column = text.splitlines()[1].index("drop_rate") + 1
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr.startswith(f"moespec: error: {path}:2:{column}: backbone.kwargs.drop_rate: ")
    assert "is not a finite number" in result.stderr and result.stderr.count("\n") == 1

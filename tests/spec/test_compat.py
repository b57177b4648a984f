"""Specs of the previous release (0.1, moespec f18f618) keep working: `top_k` and `capacity_factor` on the
surgery group move into the router (moespec/spec/compat.py), and `moespec validate --fix` rewrites a file in
the new form."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import moespec
from moespec.cli import app
from moespec.errors import SpecError
from moespec.spec.compat import CannotRewrite, upgraded_text

from ..conftest import TINY_VIT, make_spec

ROOT = Path(__file__).parents[2]
RELEASE_0_1 = ROOT / "tests" / "data" / "release_0_1"
OLD_SPECS = sorted((RELEASE_0_1 / "specs").glob("*.yaml"))  # specs/ as release 0.1 shipped it


SINCE_THE_PREVIOUS_RELEASE = {"upcycle_vit_b16_ec32_every2.yaml", "upcycle_vit_s16_drop_e8_top2.yaml",
                              "upcycle_vit_s16_multisource_e4_top2.yaml", "vmoe_s32_last2_e8_top2.yaml",
                              "vmoe_s32_last2_e8_top2_384.yaml", "vmoe_b16_every2_e8_top2_21k.yaml",
                              "vmoe_b16_every2_e8_top2_384.yaml"}
"""Shipped specs newer than release 0.1: issue 49's upcycling recipes, written with fields it did not have
(`upcycle.drop`, `router_init: hidden`), and issue 60's released V-MoE checkpoints (`capacity_multiple`,
`backbone.pre_logits`)."""


def test_the_previous_release_shipped_every_spec_we_ship():
    shipped = sorted(path.name for path in (ROOT / "specs").glob("*.yaml"))
    assert [path.name for path in OLD_SPECS] == [name for name in shipped if name not in SINCE_THE_PREVIOUS_RELEASE]
    assert SINCE_THE_PREVIOUS_RELEASE <= set(shipped)


CORRECTED = {"convnext_t_moe8_every2_top1": {"where": [{"stage_every": 2}]}}
"""Shipped specs that release 0.1 got wrong, and the surgery-group fields that correct them: ConvNeXt-T
"Every 2" counts every second block within each stage (the sweet-spot study's 97.5M; `{every: 2}` across
the stages gave 132.5M, issue 38)."""


@pytest.mark.parametrize("old", OLD_SPECS, ids=lambda path: path.stem)
def test_a_shipped_spec_of_the_previous_release_is_the_shipped_spec(old):
    new = ROOT / "specs" / old.name
    was, now = moespec.load_spec(old).model_dump(), moespec.load_spec(new).model_dump()
    if old.stem in CORRECTED:
        was["moe"] = [{**group, **CORRECTED[old.stem]} for group in was["moe"]]
        assert was == now
        return
    assert was == now
    assert upgraded_text(old.read_text()) == new.read_text()  # --fix wrote the shipped files


def test_a_python_dict_of_the_previous_release_is_its_new_form():
    old = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4, "top_k": 2, "capacity_factor": 1.25,
                                "router": {"kind": "topk", "bpr": True}}])
    new = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4,
                                "router": {"kind": "topk", "bpr": True, "top_k": 2, "capacity_factor": 1.25}}])
    assert old == new
    assert new.moe[0].router.top_k == 2 and new.moe[0].router.capacity_factor == 1.25


def test_top_k_1_on_a_kind_without_top_k_was_the_default_and_is_dropped():
    """Release 0.1 allowed `top_k: 1` (its default) beside any router."""
    for router in ({"kind": "soft"}, {"kind": "expert_choice", "capacity": 2.0}):
        old = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4, "top_k": 1, "router": router}])
        assert old == make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4, "router": router}])


def _problems(text: str, tmp_path: Path) -> list[tuple[int | None, str, str]]:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as error:
        moespec.load_spec(path)
    return [(p.line, p.path, p.message) for p in error.value.problems]


def test_a_setting_given_in_both_places_is_refused_at_the_group_key(tmp_path):
    text = ("backbone: {model: vit_small_patch16_224}\nmoe:\n  - where: {every: 2}\n    experts: 4\n"
            "    top_k: 2\n    router: {kind: topk, top_k: 1}\n")
    assert _problems(text, tmp_path) == [
        (5, "moe.0.top_k", "top_k is given twice, here and as router.top_k; keep router.top_k and remove this one")]


def test_an_error_about_a_moved_key_points_at_its_line_in_either_form(tmp_path):
    old = "backbone: {model: vit_small_patch16_224}\nmoe:\n  - where: {every: 2}\n    experts: 4\n    top_k: 5\n"
    new = ("backbone: {model: vit_small_patch16_224}\nmoe:\n  - where: {every: 2}\n    experts: 4\n"
           "    router:\n      top_k: 5\n")
    assert _problems(old, tmp_path) == [(5, "moe.0.top_k", "top_k (5) must be between 1 and experts (4)")]
    assert _problems(new, tmp_path) == [(6, "moe.0.router.top_k", "top_k (5) must be between 1 and experts (4)")]
    bad_type = old.replace("top_k: 5", "capacity_factor: -1")
    assert _problems(bad_type, tmp_path) == [(5, "moe.0.capacity_factor", "input should be greater than 0")]


def test_a_checkpoint_written_by_the_previous_release_loads():
    """tests/data/release_0_1/tiny.safetensors was saved by release 0.1 (spec tiny.yaml inside, in the old form),
    and tiny_logits.json holds that release's logits on a fixed input."""
    model = moespec.load(RELEASE_0_1 / "tiny.safetensors").eval()
    expected = json.loads((RELEASE_0_1 / "tiny_logits.json").read_text())
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), torch.tensor(expected["logits"]), rtol=1e-5, atol=1e-6)
    first, second = moespec.plan(moespec.load_spec(RELEASE_0_1 / "tiny.yaml")).layers
    assert (first.router.top_k, first.router.capacity_factor, second.router.top_k) == (2, 1.5, 1)


def test_validate_notes_the_old_form_and_fix_rewrites_it_keeping_comments_and_permissions(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("# my spec\nbackbone: {model: vit_small_patch16_224, kwargs: {depth: 2, img_size: 64}}\nmoe:\n"
                    "  - where: {every: 2}  # every second block\n    experts: 4\n    top_k: 2  # two experts\n"
                    "    router:\n      kind: topk\n      normalize: true\n    capacity_factor: 1.25\n")
    os.chmod(path, 0o640)
    before = moespec.load_spec(path)
    runner = CliRunner()
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 0
    assert (f"moespec: note: {path}: moe.0.top_k, moe.0.capacity_factor: the previous release's form, still read; "
            "`moespec validate --fix` moves it into the router") in result.stderr
    result = runner.invoke(app, ["validate", "--fix", str(path)])
    assert result.exit_code == 0, result.output
    assert f"moespec: fixed: {path}: moe.0.top_k, moe.0.capacity_factor: moved into the router" in result.stderr
    assert path.read_text() == (
        "# my spec\nbackbone: {model: vit_small_patch16_224, kwargs: {depth: 2, img_size: 64}}\nmoe:\n"
        "  - where: {every: 2}  # every second block\n    experts: 4\n"
        "    router:\n      kind: topk\n      top_k: 2\n      capacity_factor: 1.25  # two experts\n"
        "      normalize: true\n")
    assert moespec.load_spec(path).model_dump() == before.model_dump()
    assert path.stat().st_mode & 0o777 == 0o640
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 0 and "note" not in result.stderr  # the new form: nothing to say


def test_fix_refuses_what_it_cannot_rewrite_and_leaves_the_file(tmp_path):
    path = tmp_path / "flow.yaml"
    text = ("backbone: {model: vit_small_patch16_224, kwargs: {depth: 2}}\n"
            "moe: [{where: {every: 2}, experts: 4, top_k: 2}]\n")
    path.write_text(text)
    with pytest.raises(CannotRewrite, match="flow style"):
        upgraded_text(text)
    result = CliRunner().invoke(app, ["validate", "--fix", str(path)])
    assert result.exit_code == 2
    assert "cannot move moe.0.top_k into the router without losing what the file says" in result.stderr
    assert "Traceback" not in result.output
    assert path.read_text() == text


@pytest.mark.parametrize("router, expected", [
    ("    router: {}\n", "    router: {top_k: 2}\n"),
    ("    router: {gate: cosine}\n", "    router: {top_k: 2, gate: cosine}\n"),
    ("    router:\n      gate: cosine\n", "    router:\n      top_k: 2\n      gate: cosine\n"),
    ("", "    router: {top_k: 2}\n"),
])
def test_fix_puts_the_setting_after_kind_or_first(router, expected):
    head = "backbone: {model: vit_small_patch16_224}\nmoe:\n  - where: {every: 2}\n    experts: 4\n"
    assert upgraded_text(head + "    top_k: 2\n" + router) == head + expected

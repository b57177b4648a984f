"""timm's own test suite holds on moespec names (issue 63, point 1): timm 1.0.31's `tests/test_models.py`,
vendored unchanged in tests/timm_suite/, runs in a subprocess with the plugin tests/timm_suite/moespec_names.py.
Every timm test that runs there on one of six dense backbones runs on its registered MoE twins too (eight
specs: six families, four router kinds), and each MoE result must be its dense twin's. The only exceptions are
the tests in the plugin's NOT_APPLICABLE, which must fail on the MoE names with moespec's own refusal
(reported as xfailed) while they pass on the dense backbones; docs/coverage.md lists them with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parent / "timm_suite"
sys.path.insert(0, str(SUITE))
import moespec_names  # noqa: E402  (the plugin's tables: the names, their twins, what cannot apply)

sys.path.remove(str(SUITE))
DOCS = Path(__file__).resolve().parent.parent / "docs" / "coverage.md"


def _outcome(case: ElementTree.Element) -> tuple[str, str]:
    for child in case:
        if child.tag in ("failure", "error"):
            return child.tag, child.get("message", "")
        if child.tag == "skipped":
            kind = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
            return kind, child.get("message", "")
    return "passed", ""


def _parts(name: str) -> tuple[str, list[str]]:
    """'test_model_forward[1-convnext_atto.d2_in1k]' -> ('test_model_forward', ['1', 'convnext_atto.d2_in1k'])."""
    function, _, params = name.partition("[")
    return function, params.rstrip("]").split("-") if params else []


def _key(name: str, model: str) -> tuple[str, tuple[str, ...]]:
    """A case with `model` (tagged or not) in its parameters, that model's place marked."""
    function, parts = _parts(name)
    return function, tuple("*" if part.partition(".")[0] == model else part for part in parts)


@pytest.mark.slow
def test_timm_test_models_gives_the_moe_names_their_dense_twins_results(tmp_path):
    report = tmp_path / "timm_suite.xml"
    env = {**os.environ, "PYTHONPATH": str(SUITE), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", "pytest.ini", "--rootdir", ".", "--confcutdir", ".", "-q",
         "timm_test_models_1_0_31.py", f"--junitxml={report}"],
        cwd=SUITE, env=env, capture_output=True, text=True, timeout=2400)
    assert report.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    results = {case.get("name"): _outcome(case) for case in ElementTree.parse(report).iter("testcase")}
    moe_cases = {name: moe for name in results for moe in moespec_names.MOE_NAMES if moe in _parts(name)[1]}
    dense = {}  # (backbone, function, parameters with the backbone's place marked) -> (dense case, its backbone)
    for name in set(results) - set(moe_cases):
        backbone, = (b for b in moespec_names.DENSE if "*" in _key(name, b)[1])
        dense[(backbone, *_key(name, backbone))] = name, backbone
    twins = sum(len(moespec_names.TWINS[backbone]) for _, backbone in dense.values())
    assert len(moe_cases) == twins, f"{len(moe_cases)} MoE cases ran for {twins} twins of the dense cases"

    wrong = []
    for case, moe in sorted(moe_cases.items()):
        twin, backbone = dense.get((moespec_names.MOE_NAMES[moe][0], *_key(case, moe)), (None, None))
        (moe_kind, moe_text), function = results[case], _parts(case)[0]
        if backbone != moespec_names.MOE_NAMES[moe][0]:
            wrong.append(f"{case}: its dense backbone's case did not run")
            continue
        dense_kind = results[twin][0]
        if function in moespec_names.NOT_APPLICABLE:
            if not (dense_kind == "passed" and moe_kind == "xfailed" and "not applicable" in moe_text):
                wrong.append(f"{case}: {moe_kind} {moe_text[:300]!r} (not applicable; dense {twin}: {dense_kind})")
        elif moe_kind != dense_kind:
            wrong.append(f"{case}: {moe_kind} {moe_text[:300]!r}, dense {twin}: {dense_kind}")
    assert not wrong, "\n".join(wrong)
    assert all(kind != "error" for kind, _ in results.values())
    passed = sum(results[name][0] == "passed" for name, _ in dense.values())
    assert passed >= 0.9 * len(dense), f"only {passed} of {len(dense)} dense cases passed"


def test_the_suite_covers_six_families_and_three_router_kinds():
    families = {backbone.split("_")[0] for backbone, _ in moespec_names.MOE_NAMES.values()}
    kinds = {moespec_names._spec(name).moe[0].router.kind for name in moespec_names.MOE_NAMES}
    assert len(families) >= 6 and len(kinds) >= 3, (families, kinds)


def test_docs_list_every_timm_test_that_cannot_apply_with_its_reason():
    text = DOCS.read_text().partition("## timm's own tests on moespec names")[2]
    for function in moespec_names.NOT_APPLICABLE:
        assert f"`{function}`" in text, function

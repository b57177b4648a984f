"""The `moespec` command line, run as subprocesses.

Every command pays the torch/timm import (seconds), so all of them are started at once, in parallel, by one
module fixture; each test then checks the result of its own command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # each test runs moespec in subprocesses (CI runs them; README)

SPECS = Path(__file__).resolve().parent.parent / "specs"
SPEC_FILES = sorted(SPECS.glob("*.yaml"))
STATS_PAIR = [str(SPECS / "convnext_t_dense.yaml"), str(SPECS / "vit_s16_moe8_every2_top2.yaml")]
CONSOLE_SCRIPT = Path(sys.executable).parent / "moespec"

BAD_TOP_K = """\
backbone:
  model: vit_small_patch16_224
moe:
  - where: {every: 2}
    experts: 2
    top_k: 3
"""
BAD_TOP_K_LINE = 6  # the `top_k` line of the group

LONG_MESSAGE = """\
backbone:
  model: vit_small_patch16_224
moe:
  - where: {every: 2}
    experts: 8
    exprts: 8
"""
LONG_MESSAGE_LINE = 6


@dataclass
class Result:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


def run_all(commands: dict[str, list[str]], cwd: Path, env: dict) -> dict[str, Result]:
    """Run `commands` concurrently (each mostly waits on its own torch/timm import)."""

    def run(argv: list[str]) -> Result:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
        return Result(argv, done.returncode, done.stdout, done.stderr)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        futures = {name: pool.submit(run, argv) for name, argv in commands.items()}
        return {name: future.result() for name, future in futures.items()}


def moespec_argv(*args: str, script: bool = False) -> list[str]:
    if script and CONSOLE_SCRIPT.exists():
        return [str(CONSOLE_SCRIPT), *args]
    return [sys.executable, "-m", "moespec.cli", *args]


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cli")
    good = SPECS / "vit_s16_moe8_every2_top2.yaml"
    bad = root / "bad.yaml"
    bad.write_text(BAD_TOP_K)
    # a long file name, so that the one-line error is longer than any terminal width
    long = root / ("a_spec_file_with_a_rather_long_name_" * 3 + ".yaml")
    long.write_text(LONG_MESSAGE)
    folder = root / "folder"
    folder.mkdir()
    (folder / "a_good.yaml").write_text((SPECS / "vit_s16_dense.yaml").read_text())
    (folder / "b_bad.yaml").write_text(BAD_TOP_K)
    missing = root / "does_not_exist.yaml"

    commands = {
        "validate_good": moespec_argv("validate", str(good)),
        "validate_bad": moespec_argv("validate", str(bad), str(long)),
        "validate_folder": moespec_argv("validate", str(folder), script=True),
        "validate_missing": moespec_argv("validate", str(missing)),
        "plan": moespec_argv("plan", str(SPECS / "convnext_t_moe4_last2_top1.yaml"), script=True),
        "stats_json": moespec_argv("stats", str(SPECS), "--format", "json"),
        "stats_csv": moespec_argv("stats", *STATS_PAIR, "--format", "csv"),
        "stats_markdown": moespec_argv("stats", *STATS_PAIR, "-f", "markdown"),
        "stats_mixed": moespec_argv("stats", str(folder), "-f", "csv", "--per-layer"),
    }
    env = {**os.environ, "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}
    env.pop("FORCE_COLOR", None)
    results = run_all(commands, root, env)
    return {"results": results, "good": good, "bad": bad, "long": long, "folder": folder, "missing": missing}


def no_traceback(result: Result) -> None:
    assert "Traceback" not in result.stdout + result.stderr
    assert "internal error" not in result.stderr


def test_validate_good_spec(cli):
    result = cli["results"]["validate_good"]
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"ok: {cli['good']} (vit_small_patch16_224, 6 MoE layers)\n"
    assert result.stderr == ""


def test_validate_bad_spec(cli):
    """`validate bad.yaml long.yaml`: both fail; the first one's problem is the first stderr line."""
    result = cli["results"]["validate_bad"]
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("moespec: error: ")
    assert f"{cli['bad']}:{BAD_TOP_K_LINE}:5: moe.0.top_k: " in result.stderr
    assert result.stderr.splitlines()[0] == (
        f"moespec: error: {cli['bad']}:{BAD_TOP_K_LINE}:5: moe.0.top_k: top_k (3) must be between 1 and experts (2)"
    )
    assert f"{cli['long']}:{LONG_MESSAGE_LINE}:5: moe.0.exprts: unknown key 'exprts'" in result.stderr
    no_traceback(result)


def test_validate_long_error_stays_on_one_line(cli):
    """Errors are `file:line:col: path: message` lines for editors and grep; they must not be wrapped
    at the console width when stderr is not a terminal."""
    result = cli["results"]["validate_bad"]
    expected = (f"moespec: error: {cli['long']}:{LONG_MESSAGE_LINE}:5: moe.0.exprts: unknown key 'exprts'; allowed: "
                "where, sublayer, experts, expert_hidden, expert_mlp_ratio, shared_experts, router, aux_loss; "
                "did you mean 'experts'?")
    assert len(expected) > 240  # longer than the width rich falls back to
    assert result.stderr.splitlines()[1:] == [expected]


def test_validate_folder_reports_the_bad_spec(cli):
    result = cli["results"]["validate_folder"]
    folder = cli["folder"]
    assert result.returncode == 2
    assert result.stdout == f"ok: {folder / 'a_good.yaml'} (vit_small_patch16_224, 0 MoE layers)\n"
    assert result.stderr == (
        f"moespec: error: {folder / 'b_bad.yaml'}:{BAD_TOP_K_LINE}:5: moe.0.top_k: top_k (3) must be between 1 and "
        "experts (2)\n"
    )
    no_traceback(result)


def test_validate_missing_file(cli):
    result = cli["results"]["validate_missing"]
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == f"moespec: error: {cli['missing']}: no such spec file\n"
    no_traceback(result)


def test_plan_prints_the_moe_layers(cli):
    result = cli["results"]["plan"]
    assert result.returncode == 0, result.stderr
    no_traceback(result)
    assert "convnext-t-moe4-last2-top1" in result.stdout
    # rich draws the header with heavy bars (┃) and the body with light ones (│)
    rows = [[cell.strip() for cell in line.replace("┃", "│").split("│")[1:-1]]
            for line in result.stdout.splitlines() if line.startswith(("│", "┃"))]
    assert rows == [
        ["module", "family", "in", "dense hidden", "expert hidden", "experts", "k", "shared", "router"],
        ["stages.2.blocks.8.mlp", "Mlp", "384", "1536", "768", "4", "1", "0", "topk/linear"],
        ["stages.3.blocks.2.mlp", "Mlp", "768", "3072", "1536", "4", "1", "0", "topk/linear"],
    ]


def test_stats_json(cli):
    result = cli["results"]["stats_json"]
    assert result.returncode == 0, result.stderr
    records = json.loads(result.stdout)
    assert isinstance(records, list)
    assert [r["spec"] for r in records] == [str(p) for p in SPEC_FILES]
    assert [r["name"] for r in records] == [p.stem.replace("_", "-") for p in SPEC_FILES]  # the specs' names
    keys = ["name", "spec", "backbone", "input_size", "total_params", "activated_params", "dense_params", "gmacs",
            "dense_gmacs", "moe_layers", "experts_total", "layers", "eval_activated_params", "eval_gmacs",
            "dispatch_flops", "attention_matmuls"]  # the counting conventions (issue 51): the defaults here
    for record, path in zip(records, SPEC_FILES, strict=True):
        assert list(record) == keys
        routers = [entry.get("router", {}) for entry in yaml.safe_load(path.read_text()).get("moe") or []]
        overrides = {key for router in routers for key in ("eval_top_k", "eval_capacity_factor") if key in router}
        if not overrides:  # the eval figures are the training ones: null
            assert record["eval_activated_params"] is None and record["eval_gmacs"] is None, record["name"]
        else:  # V-MoE evaluates at a larger capacity only; a count is k experts a token, which capacity only drops
            assert overrides == {"eval_capacity_factor"}, record["name"]
            assert (record["eval_activated_params"], record["eval_gmacs"]) == (
                record["activated_params"], record["gmacs"]), record["name"]
        assert (record["dispatch_flops"], record["attention_matmuls"]) == ("gather", "count")
        assert type(record["gmacs"]) is float and type(record["dense_gmacs"]) is float
        for layer in record["layers"]:
            assert {"path", "experts", "top_k", "shared_experts", "params", "activated_params", "gmacs",
                    "activated"} <= set(layer)
        for key in ("total_params", "activated_params", "dense_params"):
            assert type(record[key]) is int and record[key] > 0, (record["name"], key)
    by_name = {r["name"]: r for r in records}
    dense = {r["backbone"]: r for r in (by_name["convnext-t-dense"], by_name["vit-s16-dense"])}
    for d in dense.values():
        assert d["total_params"] == d["activated_params"] == d["dense_params"]
        assert (d["moe_layers"], d["experts_total"], d["layers"]) == (0, 0, [])
    for record in records:
        if record["name"].startswith(("vit-s16-", "convnext-t-")):  # same backbone as the dense baseline
            assert record["dense_params"] == dense[record["backbone"]]["total_params"], record["name"]
    moe = {name: r for name, r in by_name.items() if r["moe_layers"]}
    assert {name: (moe[name]["moe_layers"], moe[name]["experts_total"]) for name in (
        "convnext-t-moe4-last2-top1", "convnext-t-moe8-last2-top1", "vit-s16-moe8-every2-top2",
        "vit-s16-moe8-last2-top2", "softmoe-l16-e128-half")} == {
        "convnext-t-moe4-last2-top1": (2, 8),
        "convnext-t-moe8-last2-top1": (2, 16),
        "vit-s16-moe8-every2-top2": (6, 48),
        "vit-s16-moe8-last2-top2": (2, 16),
        "softmoe-l16-e128-half": (12, 1536),
    }
    for record in moe.values():
        if not record["name"].startswith("softmoe"):  # Soft MoE: every expert is used for every sequence
            assert record["activated_params"] < record["total_params"], record["name"]
    assert [layer["path"] for layer in by_name["convnext-t-moe4-last2-top1"]["layers"]] == [
        "stages.2.blocks.8.mlp", "stages.3.blocks.2.mlp",
    ]


def test_stats_csv(cli):
    result = cli["results"]["stats_csv"]
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == ("name,backbone,MoE layers,experts (all layers),params (M),activated (M),GMACs,dense params (M),"
                        "dense GMACs")
    assert len(lines) == 1 + len(STATS_PAIR)
    assert lines[1].startswith("convnext-t-dense,convnext_tiny,0,0,28.59,28.59,4.470,28.59,4.470")


def test_stats_markdown(cli):
    result = cli["results"]["stats_markdown"]
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == ("| name | backbone | MoE layers | experts (all layers) | params (M) | activated (M) | GMACs | "
                        "dense params (M) | dense GMACs |")
    assert lines[1] == "|---|---|---|---|---|---|---|---|---|"
    rows = [line for line in lines[2:] if line.startswith("| ")]
    assert len(rows) == len(STATS_PAIR)
    assert rows[1] == ("| vit-s16-moe8-every2-top2 | vit_small_patch16_224 | 6 | 48 | 71.69 | 29.16 | 6.007 | 22.05 "
                       "| 4.608 |")


def test_stats_reports_a_failing_spec_and_still_prints_the_others(cli):
    result = cli["results"]["stats_mixed"]
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if not line.startswith("moespec: counting: ")]
    assert errors[0].startswith(f"moespec: error: {cli['folder'] / 'b_bad.yaml'}:")  # piped: progress lines apart
    lines = result.stdout.splitlines()
    assert lines[0] == "name,module,experts,k,shared,items,params (M),activated (M),GMACs,executed GMACs"
    assert lines[1:] == ["vit-s16-dense,(dense remainder),-,-,-,-,22.05,22.05,4.608,-"]

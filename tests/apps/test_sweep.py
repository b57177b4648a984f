"""Sweeps: parsing --set, walking the spec document, the grid, the Pareto front, and the command."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from moespec.apps.sweep import (
    Setting,
    assign,
    check_grid_size,
    check_settings,
    grid,
    pareto_front,
    parse_setting,
    split_values,
    sweep,
)
from moespec.cli import app
from moespec.counting import SpecStats, render
from moespec.errors import MoespecError

from ..conftest import TINY_SPEC_YAML


@pytest.mark.parametrize("text,values", [
    ("4,8,16", ["4", "8", "16"]),
    ("{every: 2},{last: 2}", ["{every: 2}", "{last: 2}"]),
    ("[{every: 2}, {last: 1}]", ["[{every: 2}, {last: 1}]"]),
    ("{stages: {2: [4, -1]}}, {stage_last: 2}", ["{stages: {2: [4, -1]}}", "{stage_last: 2}"]),
    ("'a,b',\"c,d\",e", ["'a,b'", '"c,d"', "e"]),
])
def test_values_split_at_top_level_commas(text, values):
    assert split_values(text) == values


def test_settings_parse_as_yaml_values():
    assert parse_setting("moe.0.experts=4,8") == Setting("moe.0.experts", (4, 8))
    assert parse_setting("moe.0.where={every: 2},[{last: 1}, {first: 1}]").values == (
        {"every": 2}, [{"last": 1}, {"first": 1}])
    assert parse_setting("moe.0.router.normalize=true,false").values == (True, False)
    assert parse_setting("moe.0.capacity_factor=null,1.25").values == (None, 1.25)


@pytest.mark.parametrize("text,message", [
    ("moe.0.experts", "expected PATH=VALUES"),
    ("=4", "expected PATH=VALUES"),
    ("moe..experts=4", "expected PATH=VALUES"),
    ("moe.0.experts=4,,8", "an empty value"),
    ("moe.0.where={every: 2", "is not a YAML value"),
])
def test_malformed_settings_say_what_is_expected(text, message):
    with pytest.raises(MoespecError, match=message):
        parse_setting(text)


def test_grid_is_the_cartesian_product_first_setting_slowest():
    points = grid([Setting("a", (1, 2)), Setting("b", ("x", "y", "z"))])
    assert points == [{"a": a, "b": b} for a in (1, 2) for b in ("x", "y", "z")]


def test_assign_walks_keys_and_indices_and_creates_mappings():
    document = {"backbone": {"model": "m"}, "moe": [{"where": {"stages": {2: [1]}}, "experts": 4}]}
    assign(document, parse_setting("moe.0.router.kind=soft"), "soft")
    assign(document, parse_setting("moe.-1.experts=8"), 8)
    assign(document, parse_setting("moe.0.where.stages.2=[0]"), [0])  # a YAML int key
    assign(document, parse_setting("backbone.kwargs.depth=3"), 3)  # kwargs take any key
    assert document == {"backbone": {"model": "m", "kwargs": {"depth": 3}},
                        "moe": [{"where": {"stages": {2: [0]}}, "experts": 8, "router": {"kind": "soft"}}]}


@pytest.mark.parametrize("text,message", [
    ("moe.1.experts=8", "moe is a list of 1 item(s); '1' is not an index in 0..0"),
    ("moe.first.experts=8", "'first' is not an index"),
    ("moe.0.exprts=8", "unknown key 'exprts' in moe.0; allowed: where, sublayer, experts,"),
    ("moe.0.exprts=8", "did you mean 'experts'?"),
    ("inputsize=[3, 32, 32]", "unknown key 'inputsize' in the spec"),
    ("moe.0.router.slots_per_expert=2", "unknown key 'slots_per_expert' in moe.0.router"),  # not a topk option
    ("backbone.model.name=x", "backbone.model is m, not a mapping or a list"),
])
def test_bad_paths_fail_before_any_work(text, message):
    document = {"backbone": {"model": "m"}, "moe": [{"where": {"every": 2}, "experts": 4, "router": {"kind": "topk"}}]}
    with pytest.raises(MoespecError) as error:
        check_settings(document, [parse_setting(text)])
    assert message in str(error.value)


def test_a_path_set_twice_is_refused():
    with pytest.raises(MoespecError, match="set twice"):
        check_settings({"moe": [{}]}, [parse_setting("moe.0.experts=4"), parse_setting("moe.0.experts=8")])


def _record(params: int, gmacs: float) -> SpecStats:
    return SpecStats("s", "", "b", (3, 8, 8), params, params, 10, gmacs, 1.0, 1, 4)


def test_pareto_front_keeps_the_most_parameters_for_the_compute():
    records = [_record(100, 1.0), _record(200, 1.0), _record(200, 2.0), _record(300, 3.0), _record(150, 2.5),
               _record(300, 3.0)]
    # 0 is beaten by 1 (more params, same GMACs); 2 by 1; 4 by 1; 3 and 5 tie and both stay
    assert pareto_front(records) == [1, 3, 5]


@pytest.fixture(scope="module")
def tiny_spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("sweep") / "tiny.yaml"
    path.write_text(TINY_SPEC_YAML)
    return path


def test_sweep_counts_every_point_and_reports_the_invalid_ones(tiny_spec):
    progress = []
    settings = [parse_setting("moe.0.experts=2,4"), parse_setting("moe.0.router.top_k=1,3")]
    points = sweep(tiny_spec, settings, on_point=lambda item, done, total: progress.append((done, total)))
    assert [p.settings for p in points] == grid(settings)
    assert progress == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]
    invalid = [p for p in points if p.stats is None]
    assert [p.label for p in invalid] == ["moe.0.experts=2, moe.0.router.top_k=3"]
    assert invalid[0].problems == ("moe.0.router.top_k: top_k (3) must be between 1 and experts (2)",)
    valid = {(p.settings["moe.0.experts"], p.settings["moe.0.router.top_k"]): p.stats for p in points if p.stats}
    assert {key: s.experts_total for key, s in valid.items()} == {(2, 1): 4, (4, 1): 8, (4, 3): 8}
    assert all(s.name == "tiny" and s.dense_params == valid[2, 1].dense_params for s in valid.values())
    # top_k 1 -> 3 adds two experts' worth of activated parameters per layer, and no total parameters
    assert valid[4, 3].total_params == valid[4, 1].total_params
    assert valid[4, 3].activated_params > valid[4, 1].activated_params
    assert valid[2, 1].total_params < valid[4, 1].total_params


def test_a_router_setting_on_the_group_says_where_it_lives_now(tiny_spec):
    with pytest.raises(MoespecError, match=r"unknown key 'top_k' in moe\.0; .*; top_k is a router setting: "
                                           r"moe\.0\.router\.top_k"):
        sweep(tiny_spec, [parse_setting("moe.0.top_k=1,2")])


def test_render_adds_the_swept_values_as_columns(tiny_spec):
    points = [p for p in sweep(tiny_spec, [parse_setting("moe.0.where={every: 1},{last: 1}")])]
    records, settings = [p.stats for p in points], [p.settings for p in points]
    lines = render(records, "csv", settings=settings).splitlines()
    assert lines[0].startswith("name,moe.0.where,backbone,MoE layers,")
    assert [line.split(",")[:4] for line in lines[1:]] == [["tiny", "{every: 1}", "vit_small_patch16_224", "2"],
                                                           ["tiny", "{last: 1}", "vit_small_patch16_224", "1"]]
    per_layer = render(records, "csv", per_layer=True, settings=settings).splitlines()
    assert [line.split(",")[:3] for line in per_layer[1:]] == [
        ["tiny", "{every: 1}", "blocks.0.mlp"], ["tiny", "{every: 1}", "blocks.1.mlp"],
        ["tiny", "{every: 1}", "(dense remainder)"], ["tiny", "{last: 1}", "blocks.1.mlp"],
        ["tiny", "{last: 1}", "(dense remainder)"]]
    decoded = json.loads(render(records, "json", settings=settings))
    assert [r["settings"] for r in decoded] == [{"moe.0.where": {"every": 1}}, {"moe.0.where": {"last": 1}}]
    assert "moe.0.where" in render(records, "table", settings=settings)


@pytest.mark.slow
def test_sweep_command_prints_the_valid_points_lists_the_invalid_and_plots(tiny_spec):
    folder = tiny_spec.parent
    argv = [sys.executable, "-m", "moespec.cli", "sweep", str(tiny_spec), "--set", "moe.0.experts=2,4",
            "--set", "moe.0.router.top_k=1,3", "-f", "csv", "--plot", "front.png"]
    run = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2  # one point does not validate
    progress = [line for line in run.stderr.splitlines() if line.startswith("moespec: sweeping: ")]
    assert [line.split(" ")[2] for line in progress] == ["1/4", "2/4", "3/4", "4/4"]  # piped: a line per point
    assert [line for line in run.stderr.splitlines() if line not in progress] == [
        "moespec: error: point moe.0.experts=2, moe.0.router.top_k=3: moe.0.router.top_k: top_k (3) must be between "
        "1 and experts (2)",
        "moespec: wrote front.png"]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("name,moe.0.experts,moe.0.router.top_k,backbone,")
    assert [line.split(",")[1:3] for line in lines[1:]] == [["2", "1"], ["4", "1"], ["4", "3"]]
    assert (folder / "front.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((folder / "front.png").stat().st_mode) == 0o666 & ~umask  # not a temp file's 0600

    again = CliRunner().invoke(app, argv[3:-1] + [str(folder / "front.png")])
    assert again.exit_code == 2 and again.stdout == ""
    assert again.stderr == f"moespec: error: {folder / 'front.png'} already exists; pass --force to overwrite it\n"


def test_without_matplotlib_plotting_names_the_extra(monkeypatch):
    from moespec.apps.plots import require_matplotlib

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(MoespecError, match=r"moespec sweep --plot needs matplotlib.*pip install 'moespec\[plot\]'"):
        require_matplotlib("moespec sweep --plot")


def test_a_single_selector_path_knows_the_selector_keys():
    document = {"backbone": {"model": "m"}, "moe": [{"where": {"every": 2}, "experts": 4}]}
    check_settings(document, [parse_setting("moe.0.where.every=1,2")])
    with pytest.raises(MoespecError, match="unknown key 'evry' in moe.0.where; allowed: every, last, first"):
        check_settings(document, [parse_setting("moe.0.where.evry=1")])


def test_a_grid_over_the_limit_is_refused_before_any_work(tmp_path):
    settings = [parse_setting(f"moe.0.experts={','.join(map(str, range(1, 18)))}"),
                parse_setting(f"moe.0.top_k={','.join(map(str, range(1, 18)))}")]
    message = ("the grid has 289 points (17 x 17 values), more than --max-points 256; pass --max-points 289 to count "
               "them all, or give fewer values")
    with pytest.raises(MoespecError) as error:  # before the spec file is even read
        sweep(tmp_path / "absent.yaml", settings, on_point=lambda *args: pytest.fail("a point was counted"))
    assert str(error.value) == message
    result = CliRunner().invoke(app, ["sweep", str(tmp_path / "absent.yaml"), "--set", settings[0].path + "=" +
                                      ",".join(map(str, settings[0].values)), "--set", "moe.0.top_k=" +
                                      ",".join(map(str, settings[1].values))])
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"moespec: error: {message}\n")


def test_max_points_raises_the_limit(tiny_spec):
    settings = [parse_setting(f"moe.0.experts={','.join(map(str, range(1, 18)))}")] * 2
    assert check_grid_size(settings, 289) == 289
    refused = CliRunner().invoke(app, ["sweep", str(tiny_spec), "--set", "moe.0.experts=2,4", "--max-points", "1"])
    assert refused.exit_code == 2 and "the grid has 2 points (2 values), more than --max-points 1" in refused.stderr


@pytest.mark.slow
def test_max_points_lets_the_sweep_run(tiny_spec):
    allowed = CliRunner().invoke(app, ["sweep", str(tiny_spec), "--set", "moe.0.experts=2,4", "-f", "csv",
                                       "--max-points", "2"])
    assert allowed.exit_code == 0, allowed.output
    assert [line.split(",")[1] for line in allowed.stdout.splitlines()[1:]] == ["2", "4"]


def test_set_values_are_read_within_the_yaml_limits():
    """Nested brackets (1,000 were a RecursionError in PyYAML's composer) are refused past 32 levels."""
    with pytest.raises(MoespecError, match="is not a YAML value .*nests the spec deeper than 32 levels"):
        parse_setting("moe.0.where=" + "[" * 100)

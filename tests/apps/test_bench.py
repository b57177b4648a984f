"""`moespec bench`: the figures it reports hold together (spread, ratios, GMACs from `stats`, efficiency), a
training step trains, checkpoints and specs time alike, the outputs carry everything, and a missing device is
one line. No test asserts a time: the machine is shared."""

from __future__ import annotations

import csv
import io
import json
import math
import os

import pytest
import torch

import moespec
from moespec.apps import bench as bench_module
from moespec.apps.bench import Spread, bench, render
from moespec.apps.terminal import run_app
from moespec.cli import app
from tests.conftest import TINY_SPEC_YAML


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny.yaml"
    path.write_text(TINY_SPEC_YAML)
    return path


@pytest.fixture(scope="module")
def report(tiny):
    return bench([tiny], batch=2, rounds=3, warmup=1)


def test_a_spread_is_min_median_max():
    assert Spread.of([3.0, 1.0, 2.0, 10.0]) == Spread(1.0, 2.5, 10.0)


def test_the_figures_hold_together(report, tiny):
    (result,) = report.results
    for spread in (result.moe_images_per_s, result.dense_images_per_s, result.ratio):
        assert 0 < spread.min <= spread.median <= spread.max
    counted = moespec.stats(moespec.load_spec(tiny))
    assert result.moe_gmacs == pytest.approx(counted.eval_gmacs or counted.gmacs)
    assert result.dense_gmacs == pytest.approx(counted.dense_gmacs)
    assert result.gmacs_ratio == pytest.approx(result.moe_gmacs / result.dense_gmacs) and result.gmacs_ratio > 1
    assert result.efficiency == pytest.approx(result.gmacs_ratio * result.ratio.median)
    # the paired ratio lies within what the two spreads allow
    assert result.moe_images_per_s.min / result.dense_images_per_s.max <= result.ratio.median
    assert result.ratio.median <= result.moe_images_per_s.max / result.dense_images_per_s.min
    assert (result.moe_layers, result.input_size, report.rounds, report.batch) == (2, (3, 64, 64), 3, 2)


def test_the_machine_is_reported(report):
    machine = report.machine
    assert machine.threads == torch.get_num_threads() and machine.cores == os.cpu_count()
    assert machine.torch == torch.__version__ and len(machine.load_before) == len(machine.load_after) == 3
    assert report.device == "cpu" and report.mode == "eval"


def test_json_carries_everything_and_csv_one_row_per_model(report):
    record = json.loads(render(report, "json"))
    assert record["machine"]["threads"] == report.machine.threads
    assert record["results"][0]["ratio"]["median"] == report.results[0].ratio.median
    assert set(record) >= {"mode", "device", "dtype", "batch", "rounds", "warmup", "compiled"}
    (row,) = csv.DictReader(io.StringIO(render(report, "csv")))
    assert float(row["efficiency"]) == pytest.approx(report.results[0].efficiency, rel=1e-5)
    table = render(report, "table")
    assert table.startswith(f"machine: {report.machine.host}, ") and "torch threads" in table
    assert f"{report.results[0].ratio.median:.2f}" in table


def test_a_training_step_steps_the_optimizer_with_the_aux_loss(tiny):
    """The timed training step moves every trained parameter, the routers' included (their gradients come
    through the routing and the aux loss)."""
    model = moespec.create_model(moespec.load_spec(tiny), seed=0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    images = torch.randn(2, 3, 64, 64)
    step = bench_module._train_step(model, model, images, seed=0, moe=True, dtype="fp32")
    step()
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    assert "blocks.0.mlp.router.gate.weight" in moved
    assert len(moved) == len(before)


def test_a_checkpoint_times_as_its_spec(tiny, tmp_path):
    model = moespec.create_model(moespec.load_spec(tiny), seed=1)
    moespec.save(model, tmp_path / "tiny.safetensors")
    checkpoint = bench([tmp_path / "tiny.safetensors"], batch=1, rounds=1, warmup=0, train=True, dtype="bf16")
    (result,) = checkpoint.results
    assert result.source == str(tmp_path / "tiny.safetensors") and result.moe_layers == 2
    assert (checkpoint.mode, checkpoint.dtype) == ("train", "bf16")
    assert math.isfinite(result.efficiency)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", ["bench", "eval"])
def test_a_missing_device_is_one_line(capsys, tiny, command):
    """Before any model is built: `eval` is given the spec here, which it would refuse as a checkpoint later."""
    args = [str(tiny)] if command == "bench" else [str(tiny), "--images", str(tiny.parent)]
    assert run_app(app, [command, *args, "--device", "cuda"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("moespec: error: --device cuda: ") and captured.err.count("\n") == 1
    assert "use --device cpu" in captured.err


def test_a_missing_source_is_refused_before_any_model_is_built(capsys, tmp_path):
    assert run_app(app, ["bench", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err == f"moespec: error: {tmp_path / 'nope.yaml'}: no such spec, checkpoint or folder\n"


def test_the_command_prints_the_table(capsys, tiny):
    assert run_app(app, ["bench", str(tiny), "--batch", "1", "--rounds", "1", "--warmup", "0", "-f", "markdown"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("machine: ") and "| tiny |" in out

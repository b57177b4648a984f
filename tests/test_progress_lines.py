"""Progress where stderr is not a terminal (piped, redirected to a log): every long command prints one plain
line per item as it starts, `moespec: <what>: <n>/<total> <item>` (n from 1), and no bar. In process (typer's
runner: stderr is no terminal), so each command costs its work, not an import."""

from __future__ import annotations

import re

import numpy as np
from PIL import Image
from typer.testing import CliRunner

from moespec.cli import app

from .conftest import TINY_SPEC_YAML, TINY_VIT

LINE = re.compile(r"moespec: (?P<what>[^:]+): (?P<done>\d+)/(?P<total>\d+) (?P<item>\S+)")


def _progress(args: list[str]) -> list[re.Match]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.stderr
    assert "\x1b[" not in result.stderr and "\r" not in result.stderr
    lines = result.stderr.splitlines()
    matches = [LINE.fullmatch(line) for line in lines]
    assert lines and all(matches), lines
    return matches


def test_upcycle_sweep_and_inspect_print_one_line_per_item_when_piped(tmp_path, dense_checkpoint):
    (tmp_path / "spec.yaml").write_text(TINY_SPEC_YAML)
    checkpoint, _ = dense_checkpoint(TINY_VIT)

    lines = _progress(["upcycle", tmp_path / "spec.yaml", "-c", checkpoint, "-o", tmp_path / "up.safetensors",
                       "--no-check"])
    assert [(m["what"], m["done"], m["total"], m["item"]) for m in lines] == [
        ("upcycling MoE layers", "1", "2", "blocks.0.mlp"), ("upcycling MoE layers", "2", "2", "blocks.1.mlp")]

    lines = _progress(["sweep", tmp_path / "spec.yaml", "--set", "moe.0.experts=2,4,8"])
    assert [(m["what"], m["done"], m["total"]) for m in lines] == [("sweeping", str(i), "3") for i in (1, 2, 3)]

    rng = np.random.default_rng(0)
    for name in "cat", "dog":
        folder = tmp_path / "images" / name
        folder.mkdir(parents=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    lines = _progress(["inspect", tmp_path / "spec.yaml", "--images", tmp_path / "images", "-o", tmp_path / "report",
                       "--batch-size", "2"])
    assert [(m["what"], m["total"]) for m in lines] == [("routing images", "2")] * 2

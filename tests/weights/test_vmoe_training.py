"""An imported V-MoE trains like any moespec model: tools/train.py from the imported file, timm's own train.py
(tests/data/timm_train.py, vendored) through `register_timm` with the file as its initial checkpoint, and
`moespec inspect` shows its routing."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import moespec
from moespec.cli import app

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "vmoe"
TIMM_TRAIN = ROOT / "tests" / "data" / "timm_train.py"
RUN_TIMM = """\
import runpy, sys
import moespec
moespec.register_timm(sys.argv[1], name="vmoe_tiny_imported")
sys.argv = [sys.argv[2]] + sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

pytestmark = pytest.mark.slow  # training scripts in subprocesses


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    """The JAX reference imported and saved (`moespec import-vmoe`), its spec beside it, and an image folder of two
    classes (train and val, 32 px) for the scripts."""
    root = tmp_path_factory.mktemp("vmoe_train")
    result = CliRunner().invoke(app, ["import-vmoe", str(DATA / "vmoe_tiny"), "-o", str(root / "vmoe.safetensors"),
                                      "--group-size", "10"])
    assert result.exit_code == 0, result.output
    (root / "vmoe.yaml").write_text(moespec.load(root / "vmoe.safetensors").moespec_spec.to_yaml())
    generator = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for label in ("a", "b"):
            folder = root / "images" / split / label
            folder.mkdir(parents=True)
            for i in range(4):
                pixels = torch.randint(0, 256, (32, 32, 3), generator=generator, dtype=torch.uint8)
                Image.fromarray(pixels.numpy()).save(folder / f"{i}.png")
    return root


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    return {name for name in before if not torch.equal(before[name], after[name])}


def test_tools_train_fine_tunes_the_imported_model(imported):
    out = imported / "tools_run"
    argv = [sys.executable, str(ROOT / "tools" / "train.py"), str(imported / "vmoe.yaml"), "--init", "load",
            "--checkpoint", str(imported / "vmoe.safetensors"), "--steps", "2", "--batch-size", "4",
            "--synthetic-size", "8", "--log-every", "1", "--output", str(out)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "done: step 2/2" in done.stdout, done.stdout
    before = moespec.load(imported / "vmoe.safetensors").state_dict()
    after = moespec.load(out / "model.safetensors").state_dict()
    changed = _changed(before, after)
    assert "blocks.1.mlp.experts.fc1.weight" in changed and "blocks.1.mlp.router.gate.weight" in changed
    assert "fc_norm.fc.weight" in changed  # the representation layer trains too


def test_timms_train_script_fine_tunes_the_imported_model(imported):
    args = ["--data-dir", "images", "--train-split", "train", "--val-split", "val", "--model", "vmoe_tiny_imported",
            "--num-classes", "10", "--input-size", "3", "32", "32", "-b", "4", "--epochs", "1", "--device", "cpu",
            "--workers", "0", "--no-prefetcher", "--output", "timm_out", "--lr", "0.01", "--warmup-epochs", "0",
            "--initial-checkpoint", "vmoe.safetensors"]
    done = subprocess.run([sys.executable, "-c", RUN_TIMM, "vmoe.yaml", str(TIMM_TRAIN), *args], cwd=imported,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "from checkpoint 'vmoe.safetensors'" in done.stdout + done.stderr
    (run,) = (imported / "timm_out").iterdir()
    with open(run / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(row["epoch"]) for row in rows] == [0]
    assert math.isfinite(float(rows[0]["train_loss"])) and math.isfinite(float(rows[0]["eval_loss"]))
    trained = torch.load(run / "last.pth.tar", map_location="cpu", weights_only=False)["state_dict"]
    before = moespec.load(imported / "vmoe.safetensors").state_dict()
    assert "blocks.1.mlp.experts.fc2.weight" in _changed(before, {k: trained[k] for k in before})


def test_inspect_shows_the_imported_models_routing(imported):
    report = imported / "report"
    result = CliRunner().invoke(app, ["inspect", str(imported / "vmoe.safetensors"), "--images",
                                      str(imported / "images" / "val"), "-o", str(report), "--batch-size", "4"])
    assert result.exit_code == 0, result.output
    assert (report / "index.html").is_file()
    summary = json.loads((report / "summary.json").read_text())
    assert summary["images_per_class"] == [4, 4]
    assert "blocks.1.mlp" in json.dumps(summary)

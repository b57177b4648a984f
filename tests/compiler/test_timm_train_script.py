"""timm's own train.py (tests/data/timm_train.py, vendored) trains a registered moespec model with
`--torchcompile` (issue 35, point 4): the script compiles the model with inductor, trains two epochs on a
small image folder on CPU, validates, and saves its checkpoints. The model is registered the way a user
registers it before calling the script (`moespec.register_timm`, then the script run as __main__)."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

import moespec

TRAIN = Path(__file__).resolve().parent.parent / "data" / "timm_train.py"
SPEC = """\
name: tiny-train
backbone:
  model: vit_small_patch16_224
  kwargs: {depth: 2, embed_dim: 64, num_heads: 2, img_size: 32, patch_size: 8}
input_size: [3, 32, 32]
moe:
  - where: {every: 1}
    experts: 4
    router: {kind: topk, top_k: 2, capacity_factor: 1.0}
    aux_loss: {kind: switch, weight: 0.01}
"""
RUN = """\
import runpy, sys
import moespec
moespec.register_timm(sys.argv[1], name="moespec_tiny_train")
sys.argv = [sys.argv[2]] + sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _image_folder(root: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for label in ("a", "b"):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(4):
                pixels = torch.randint(0, 256, (32, 32, 3), generator=generator, dtype=torch.uint8)
                Image.fromarray(pixels.numpy()).save(folder / f"{i}.png")


@pytest.mark.slow
def test_timms_train_script_trains_a_moespec_model_with_torchcompile(tmp_path):
    _image_folder(tmp_path / "data")
    (tmp_path / "spec.yaml").write_text(SPEC)
    initial = moespec.create_model(moespec.load_spec(tmp_path / "spec.yaml"), seed=0)
    initial.reset_classifier(2)
    moespec.save(initial, tmp_path / "init.safetensors")  # the README's hand-off: --initial-checkpoint
    args = ["--data-dir", "data", "--train-split", "train", "--val-split", "val", "--model", "moespec_tiny_train",
            "--num-classes", "2", "--input-size", "3", "32", "32", "-b", "4", "--epochs", "2", "--device", "cpu",
            "--workers", "0", "--no-prefetcher", "--output", "out", "--torchcompile", "--lr", "0.01",
            "--warmup-epochs", "0", "--initial-checkpoint", "init.safetensors"]
    done = subprocess.run([sys.executable, "-c", RUN, "spec.yaml", str(TRAIN), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Compiling task components with backend=inductor" in done.stdout + done.stderr
    assert "from checkpoint 'init.safetensors'" in done.stdout + done.stderr
    (run,) = (tmp_path / "out").iterdir()
    with open(run / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(row["epoch"]) for row in rows] == [0, 1]
    assert all(math.isfinite(float(row["train_loss"])) and math.isfinite(float(row["eval_loss"])) for row in rows)
    assert (run / "model_best.pth.tar").is_file()

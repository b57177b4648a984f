"""Fine-tuning a published MoE with timm's unmodified train.py (issue 48, the sharing workflow): `--model
local-dir:FOLDER --pretrained --num-classes N` starts from the folder's weights with a new head, in a process
that only imports moespec before running the script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import load_file

import moespec

TRAIN = Path(__file__).resolve().parent.parent / "data" / "timm_train.py"
SPEC = {"name": "tiny-hub-train", "input_size": [3, 32, 32],
        "backbone": {"model": "vit_small_patch16_224",
                     "kwargs": {"depth": 2, "embed_dim": 64, "num_heads": 2, "img_size": 32, "patch_size": 8,
                                "num_classes": 5}},
        "moe": [{"where": {"every": 1}, "experts": 4, "router": {"kind": "topk", "top_k": 2}}]}
RUN = "import runpy, sys, moespec\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"


@pytest.mark.slow
def test_timms_train_script_fine_tunes_a_hub_folder(tmp_path):
    generator = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for label in ("a", "b"):
            (tmp_path / "data" / split / label).mkdir(parents=True)
            for i in range(4):
                pixels = torch.randint(0, 256, (32, 32, 3), generator=generator, dtype=torch.uint8)
                Image.fromarray(pixels.numpy()).save(tmp_path / "data" / split / label / f"{i}.png")
    moespec.save_for_hf(moespec.create_model(moespec.load_spec(SPEC), seed=0), tmp_path / "hub")
    args = ["--data-dir", "data", "--train-split", "train", "--val-split", "val", "--model", "local-dir:hub",
            "--pretrained", "--num-classes", "2", "-b", "4", "--epochs", "1", "--device", "cpu", "--workers", "0",
            "--no-prefetcher", "--output", "out", "--lr", "1e-30", "--warmup-epochs", "0", "--opt", "sgd",
            "--weight-decay", "0"]  # --lr 0 would mean "unset" to train.py
    done = subprocess.run([sys.executable, "-c", RUN, str(TRAIN), *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = (tmp_path / "out").iterdir()
    trained = torch.load(run / "last.pth.tar", map_location="cpu", weights_only=False)["state_dict"]
    published = load_file(str(tmp_path / "hub" / "model.safetensors"))
    assert trained["head.weight"].shape == (2, 64)  # a new head for the new classes
    for name in ("blocks.0.mlp.experts.fc1.weight", "blocks.1.mlp.router.gate.weight", "pos_embed"):
        torch.testing.assert_close(trained[name], published[name], rtol=0, atol=0)  # lr 1e-30: the folder's weights

    # publish the fine-tuned model (docs/sharing.md): timm reads train.py's checkpoint, moespec writes the folder
    tuned = timm.create_model(f"local-dir:{tmp_path / 'hub'}", num_classes=2, checkpoint_path=run / "last.pth.tar")
    moespec.save_for_hf(tuned, tmp_path / "hub-tuned", model_config={"label_names": ["a", "b"]})
    again = timm.create_model(f"local-dir:{tmp_path / 'hub-tuned'}", pretrained=True).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(again(x), tuned.eval()(x), rtol=0, atol=0)
    assert again.num_classes == 2 and again.pretrained_cfg["label_names"] == ["a", "b"]

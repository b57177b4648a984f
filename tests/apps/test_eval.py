"""`moespec eval`: top-1 as timm's own validate.py computes it (tests/data/timm_validate.py, vendored), on the same
folder and model; moespec checkpoints, Hub folders (moespec's and timm's) alike; unreadable images skipped and
counted; each MoE layer's load; the user's mistakes as one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
from PIL import Image
from timm.models import save_for_hf

import moespec
from moespec.apps.evaluate import evaluate, labelled_images, load_classifier, render
from moespec.apps.terminal import run_app
from moespec.cli import app
from moespec.errors import MoespecError
from tests.conftest import TINY_SPEC_YAML, randomize

VALIDATE = Path(__file__).resolve().parent.parent / "data" / "timm_validate.py"
CLASSES = ("c1", "c2", "c10")  # natural order c1, c2, c10 (sorted by name: c1, c10, c2), as timm reads them


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny MoE ViT with randomized weights (so that its predictions vary), saved as a moespec checkpoint and
    as a Hub folder, and a folder of 24 random images of several sizes in three classes."""
    root = tmp_path_factory.mktemp("eval")
    (root / "spec.yaml").write_text(TINY_SPEC_YAML)  # a ViT-S of two blocks at 64 px, 10 classes
    model = randomize(moespec.create_model(moespec.load_spec(root / "spec.yaml"), seed=0), seed=3).eval()
    moespec.save(model, root / "model.safetensors")
    moespec.save_for_hf(model, root / "hub")
    generator = np.random.default_rng(0)
    for c, name in enumerate(CLASSES):
        (root / "images" / name).mkdir(parents=True)
        for i in range(8):
            pixels = generator.integers(0, 256, (24 + 5 * i, 40 - 2 * c, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "images" / name / f"{i}.{'png' if i % 2 else 'jpg'}")
    return root


@pytest.fixture(scope="module")
def report(workspace):
    return evaluate(load_classifier(workspace / "model.safetensors"), workspace / "images", batch_size=5,
                    source="model.safetensors")


def validate_py(args: list[str], spec: Path) -> tuple[dict, float]:
    """timm's validate.py on a model registered from `spec` (the README's wrapper): its results and its loss."""
    wrapper = (f"import moespec, runpy, sys; moespec.register_timm({str(spec)!r}, name='eval_test_moe'); "
               "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", wrapper, str(VALIDATE), *args], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.split("--result", 1)[1])
    losses = re.findall(r"Loss:\s+\S+ \(\s*([\d.]+)\)", done.stdout + done.stderr)
    return results, float(losses[-1])


@pytest.mark.slow  # timm's validate.py in a subprocess
def test_top1_equals_timm_validate_py(workspace, report):
    args = ["--data-dir", str(workspace / "images"), "--model", "eval_test_moe", "--checkpoint",
            str(workspace / "model.safetensors"), "--device", "cpu", "--workers", "0", "--no-prefetcher", "-b", "64",
            "--input-size", "3", "64", "64"]
    results, loss = validate_py(args, workspace / "spec.yaml")
    assert 0 < report.top1 < 100  # the predictions vary: a wrong preprocessing or class order would show
    assert (results["top1"], results["top5"]) == (round(report.top1, 4), round(report.top5, 4))
    assert loss == pytest.approx(report.loss, abs=1e-4)
    assert (results["img_size"], results["crop_pct"], results["interpolation"]) == (
        64, report.data_config["crop_pct"], report.data_config["interpolation"])


def test_the_figures_hold_together(report):
    assert report.images == 24 and [c.name for c in report.classes] == list(CLASSES)
    assert sum(c.top1 * c.images for c in report.classes) / 24 == pytest.approx(report.top1)
    assert 0 <= report.top1 <= report.top5 <= 100 and report.loss > 0
    assert [layer.path for layer in report.layers] == ["blocks.0.mlp", "blocks.1.mlp"]
    for layer in report.layers:
        assert sum(layer.load_share) == pytest.approx(1) and layer.drop_fraction == 0  # dropless top-2
        assert layer.items == 24 * 17  # 16 patches and [CLS] per image
    assert report.data_config["input_size"] == [3, 64, 64]
    text = render(report, per_class=True)
    assert f"top-1 {report.top1:.3f}%" in text and "  c10: top-1" in text


def test_a_hub_folder_evaluates_as_its_checkpoint(workspace, report):
    hub = evaluate(load_classifier(workspace / "hub"), workspace / "images", batch_size=7)
    assert (hub.top1, hub.top5) == (report.top1, report.top5) and hub.loss == pytest.approx(report.loss)


def test_a_timm_hub_folder_of_a_dense_model(workspace, tmp_path):
    dense = randomize(timm.create_model("vit_small_patch16_224", depth=1, img_size=32, num_classes=3), seed=1)
    save_for_hf(dense.eval(), tmp_path / "dense")
    result = evaluate(load_classifier(tmp_path / "dense"), workspace / "images", input_size=(3, 32, 32))
    assert result.images == 24 and result.layers == []


def test_unreadable_images_are_skipped_and_counted(workspace, tmp_path, capsys):
    folder = tmp_path / "images"
    for name in CLASSES:
        (folder / name).mkdir(parents=True)
        for image in sorted((workspace / "images" / name).iterdir())[:2]:
            (folder / name / image.name).write_bytes(image.read_bytes())
    (folder / "c2" / "broken.png").write_bytes(b"not an image")
    (folder / "c3").mkdir()
    (folder / "c3" / "empty.jpg").write_bytes(b"")  # a class none of whose images can be read
    assert run_app(app, ["eval", str(workspace / "model.safetensors"), "--images", str(folder), "-f", "json"]) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert record["images"] == 6 and len(record["skipped"]) == 2
    assert "broken.png" in record["skipped"][0] and "empty.jpg" in record["skipped"][1]
    assert [(c["name"], c["images"]) for c in record["classes"]] == [("c1", 2), ("c2", 2), ("c3", 0), ("c10", 2)]
    assert record["classes"][2]["top1"] is None
    assert captured.err.startswith("moespec: warning: skipped an unreadable image: ")
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("make, message", [
    (lambda root: root / "spec.yaml", "a spec holds no trained weights"),
    (lambda root: root / "absent.safetensors", "no such spec, checkpoint or folder"),
])
def test_a_wrong_checkpoint_is_one_line(workspace, capsys, make, message):
    assert run_app(app, ["eval", str(make(workspace)), "--images", str(workspace / "images")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moespec: error: ") and message in err and err.count("\n") == 1


def test_a_folder_of_more_classes_than_the_head_is_refused(workspace, tmp_path):
    for c in range(11):
        (tmp_path / f"k{c}").mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / f"k{c}" / "a.png")
    with pytest.raises(MoespecError, match="11 class subfolders, but the model has 10 classes"):
        evaluate(load_classifier(workspace / "model.safetensors"), tmp_path)


def test_a_folder_without_class_subfolders_is_refused(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    with pytest.raises(MoespecError, match="no class subfolders"):
        labelled_images(tmp_path)

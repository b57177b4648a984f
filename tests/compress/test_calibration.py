"""The calibration pass streams: an image folder is read, transformed and routed a batch at a time, and only
running statistics stay. Streamed statistics equal those of one forward of every image held in memory, and
what is held does not grow with the number of images."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from PIL import Image

import moespec
from moespec.backbones.images import data_transform, image_files, read_image
from moespec.compress import calibration, prune_with_report
from moespec.compress.calibration import calibrate

from .conftest import tiny_spec


def image_folder(root, count: int, seed: int = 0):
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        Image.fromarray(rng.integers(0, 255, (40, 36, 3), dtype=np.uint8)).save(root / f"{i:03d}.png")
    return root


def in_memory(model, root) -> torch.Tensor:
    """Every image of `root` as one tensor, read here file by file with the model's transform."""
    _, transform = data_transform(model, (3, 32, 32), str(root))
    return torch.stack([read_image(path, transform, 3) for path in image_files(root)])


def test_streamed_statistics_equal_one_forward_of_every_image_in_memory(tmp_path, monkeypatch):
    root = image_folder(tmp_path / "images", 19)
    (root / "010x.png").write_bytes(b"not a png")  # skipped, and the batches after it are filled up alike
    model = moespec.create_model(tiny_spec(), seed=0).eval()
    good = tmp_path / "good"
    good.mkdir()
    for path in image_files(root):
        if path.name != "010x.png":
            (good / path.name).write_bytes(path.read_bytes())
    everything = in_memory(model, good)
    monkeypatch.setattr(calibration, "BATCH", 1000)  # one forward of all 19 images
    whole = calibrate(model, everything)
    monkeypatch.setattr(calibration, "BATCH", 4)  # 5 batches read from the folder, the last of 3
    streamed = calibrate(model, root)
    assert whole.keys() == streamed.keys() and whole
    for path, expected in whole.items():
        got = streamed[path]
        assert torch.equal(got.load, expected.load) and torch.equal(got.pairs, expected.pairs)
        assert float(expected.load.sum()) == 19 * 5 * 2  # 5 items per image, top-2
        torch.testing.assert_close(got.reap, expected.reap)
        assert got.mass == pytest.approx(expected.mass) and got.items_seen == expected.items_seen
        torch.testing.assert_close(got.sample("items"), expected.sample("items"))
        torch.testing.assert_close(got.sample("gate_inputs"), expected.sample("gate_inputs"))

    new, report = prune_with_report(model, root, keep=2)
    with torch.no_grad():
        before, after = model.eval()(everything).double(), new.eval()(everything).double()
    assert report.images == 19
    assert report.top1_agreement == pytest.approx(float((before.argmax(-1) == after.argmax(-1)).double().mean()))
    assert report.relative_logit_error == pytest.approx(float((after - before).norm() / before.norm()))


def held_during_prune(root, monkeypatch) -> tuple[int, int]:
    """The most image tensors (from the loader) and model outputs alive at once during a prune of `root`."""
    loaded: list[weakref.ref] = []
    outputs: list[weakref.ref] = []
    peaks = [0, 0]
    original = calibration.read_images

    def alive(refs: list[weakref.ref]) -> int:
        return sum(ref() is not None for ref in refs)

    def tracked(*args, **kwargs):
        read = original(*args, **kwargs)
        loaded.extend(weakref.ref(tensor) for _, tensor in read)
        peaks[0] = max(peaks[0], alive(loaded))
        return read

    def on_output(module, args, output):
        outputs.append(weakref.ref(output))
        peaks[1] = max(peaks[1], alive(outputs))

    monkeypatch.setattr(calibration, "read_images", tracked)
    model = moespec.create_model(tiny_spec(), seed=0).eval()
    hook = model.register_forward_hook(on_output)
    try:
        prune_with_report(model, root, keep=2)
    finally:
        hook.remove()
    assert len(loaded) == len(image_files(root)) * 2  # read once to calibrate, once to compare
    return peaks[0], peaks[1]


def test_what_calibration_holds_does_not_grow_with_the_number_of_images(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "BATCH", 4)
    few = held_during_prune(image_folder(tmp_path / "few", 8), monkeypatch)
    many = held_during_prune(image_folder(tmp_path / "many", 64), monkeypatch)
    assert few == many
    images, outputs = many
    assert images <= 2 * 4 and outputs == 1  # a batch being read and one being filled; the current logits only

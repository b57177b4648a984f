"""Commands that run the model on real tensors at the spec's input size are bounded before memory grows
(`planning/forward_cost.py`): `upcycle`'s logit check falls back to its per-layer check, `inspect` is refused
in one line; `compile` runs no forward at all. Peak RSS is measured, in a subprocess with a timeout."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from PIL import Image

import moespec
from moespec import SpecError
from moespec.apps.inspection import find_images, inspect_routing
from moespec.backbones import placement
from moespec.weights import upcycle_with_report

from ..conftest import TINY_CONVNEXT, make_spec, measured_run, write

HUGE = [3, 16384, 16384]  # the schema's largest: a ConvNeXt forward of about 7 TMACs and tens of GB
MOE = [{"where": {"last": 1}, "experts": 2}]
PEAK_KB = 1_500_000  # measured: about 0.9 GB, as the same commands at 64 px (torch, timm)


def _images(tmp_path, count: int = 1):
    (tmp_path / "images" / "cat").mkdir(parents=True)
    for i in range(count):
        Image.new("RGB", (32, 32)).save(tmp_path / "images" / "cat" / f"{i}.png")
    return tmp_path / "images"


def _cli(tmp_path, *args: str) -> tuple:
    env = {**os.environ, "MOESPEC_CACHE_DIR": str(tmp_path / "cache")}
    return measured_run([sys.executable, "-m", "moespec.cli", *args], timeout=120, env=env)


@pytest.mark.slow  # 7.5 s: a subprocess upcycles at the largest size (CI runs it; inspect's sibling stays quick)
def test_upcycle_at_the_largest_input_size_checks_layer_by_layer_in_bounded_memory(tmp_path):
    """`upcycle` compared the whole model's logits on a random batch at the spec's input size: at 16,384 px it
    allocated a 6.4 GB input, then the forward's activations (an internal error under a 6 GB limit), after
    the output was written. Now it checks each MoE layer against its dense FFN, as for a model too large."""
    spec = write(tmp_path, make_spec(TINY_CONVNEXT, MOE, input_size=HUGE).to_yaml())
    code, stdout, stderr, _, peak_kb = _cli(tmp_path, "upcycle", str(spec), "-o", str(tmp_path / "m.safetensors"))
    assert code == 0, stderr
    assert "each against its dense FFN; the model, or a forward at its input size, is too large" in stdout, stdout
    assert moespec.load(tmp_path / "m.safetensors").moespec_spec.input_size == tuple(HUGE)
    assert peak_kb < PEAK_KB, peak_kb


def test_inspect_at_the_largest_input_size_is_refused_in_one_line_in_bounded_memory(tmp_path):
    """`inspect` resized every image to the input size and ran the batch: at 16,384 px, 2 GB RSS before PIL's
    decompression-bomb check refused the resized image."""
    spec = write(tmp_path, make_spec(TINY_CONVNEXT, MOE, input_size=HUGE).to_yaml())
    code, stdout, stderr, _, peak_kb = _cli(tmp_path, "inspect", str(spec), "--images", str(_images(tmp_path)),
                                            "-o", str(tmp_path / "report"))
    assert (code, stdout, stderr.count("\n")) == (2, "", 1), stderr
    assert stderr.startswith(f"moespec: error: {spec}:") and "input_size: routing a batch of 1 image(s) at input " \
        "size [3, 16384, 16384] runs the forward on the CPU: about" in stderr, stderr
    assert "TMACs, more than the 4 T a batch runs; use a smaller batch size (--batch-size) or input size" in stderr
    assert not (tmp_path / "report").exists()
    assert peak_kb < PEAK_KB, peak_kb


@pytest.mark.slow
def test_compile_at_the_largest_input_size_runs_no_forward(tmp_path):
    """`compile` builds and saves; nothing it does grows with the input size of a ConvNeXt."""
    spec = write(tmp_path, make_spec(TINY_CONVNEXT, MOE, input_size=HUGE).to_yaml())
    code, _, stderr, _, peak_kb = _cli(tmp_path, "compile", str(spec), "-o", str(tmp_path / "m.safetensors"))
    assert code == 0, stderr
    assert peak_kb < PEAK_KB, peak_kb


def test_an_inspect_batch_whose_activations_do_not_fit_is_refused_before_any_image_is_read(tmp_path, monkeypatch):
    """Few MACs but large activations: a ConvNeXt at 512 px on a machine of 100 MB. A batch of one fits where
    a batch of two does not, and the message says which knob to turn."""
    spec = make_spec(TINY_CONVNEXT, MOE, input_size=[3, 512, 512])
    model = moespec.create_model(spec)
    folder = find_images(_images(tmp_path, 2))
    monkeypatch.setattr(placement, "device_memory", lambda device: 100 * 10**6)
    with monkeypatch.context() as unread:
        unread.setattr(Image, "open", lambda *args, **kwargs: pytest.fail("an image was read"))
        with pytest.raises(SpecError) as error:
            inspect_routing(model, folder, batch_size=2)
    (problem,) = error.value.problems
    assert problem.path == "input_size"
    assert problem.message.startswith("routing a batch of 2 image(s) at input size [3, 512, 512] runs the forward")
    assert "of activations, more than 80% of this machine's memory (80.0 MB); use a smaller batch size" in \
        problem.message, problem.message
    assert inspect_routing(model, folder, batch_size=1).images_per_class == [2]


def test_the_library_upcycle_check_is_refused_where_its_forward_does_not_fit(monkeypatch):
    """`upcycle_with_report` (the model in memory) has no per-layer check to fall back to: its check is refused
    before the forward, and runs nothing without it."""
    spec = make_spec(TINY_CONVNEXT, MOE, input_size=[3, 512, 512])
    monkeypatch.setattr(placement, "device_memory", lambda device: 100 * 10**6)
    with pytest.raises(SpecError, match=r"input_size: checking the upcycled logits at input size \[3, 512, 512\] "
                                        r"runs the forward on the CPU: about .* of activations.*or check=False"):
        upcycle_with_report(spec)
    model, report = upcycle_with_report(spec, check=False)
    assert report is None and isinstance(model, torch.nn.Module)


@pytest.mark.parametrize("command", ["upcycle", "inspect"])
def test_an_input_size_the_model_does_not_take_is_one_error_before_anything_is_written(tmp_path, command):
    """A ViT built for 224 px with `input_size: [3, 96, 96]` (validate refuses it; compile builds it): upcycle's
    check and inspect ran the forward and exited 1 ("internal error: AssertionError: Input height (96) doesn't
    match model (224)"), upcycle after writing its output. Now it is the validate's error, and nothing is
    written."""
    from typer.testing import CliRunner

    from moespec.cli import app

    vit = {"model": "vit_small_patch16_224", "kwargs": {"depth": 1, "embed_dim": 32, "num_heads": 2}}
    spec = write(tmp_path, make_spec(vit, MOE, input_size=[3, 96, 96]).to_yaml())
    out = tmp_path / ("m.safetensors" if command == "upcycle" else "report")
    extra = ["--images", str(_images(tmp_path))] if command == "inspect" else []
    result = CliRunner().invoke(app, [command, str(spec), "-o", str(out), *extra])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (
        f"moespec: error: {spec}:11:1: input_size: the model cannot take input size [3, 96, 96]: Input height (96) "
        f"doesn't match model (224); models with a fixed input size take it as img_size (and in_chans) in "
        f"backbone.kwargs"), result.output
    assert not out.exists()

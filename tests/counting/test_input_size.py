"""One rule for the input size (issue 52): `--input-size` passes the checks of the spec's `input_size` (its
ranges, the backbone's refusals), says when it rebuilds a fixed-size model at another `img_size`, and a
patch grid that would drop pixels is refused in both."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from moespec import SpecError, load_spec, plan
from moespec.cli import app

from ..conftest import TINY_CONVNEXT, TINY_VIT, make_spec, write

MOE = [{"where": {"last": 1}, "experts": 4}]


def _stats(tmp_path, backbone, *size):
    path = write(tmp_path, make_spec(backbone, MOE).to_yaml())
    result = CliRunner().invoke(app, ["stats", str(path), "--format", "csv", "--input-size", *map(str, size)])
    return path, result


def test_a_rebuild_at_another_img_size_is_said(tmp_path):
    path, result = _stats(tmp_path, TINY_VIT, 3, 96, 96)
    assert result.exit_code == 0, result.output
    assert result.stderr == (f"moespec: note: {path}: vit_small_patch16_224 rebuilt at img_size 96 for --input-size "
                             f"3 96 96 (the spec builds it at img_size 64)\n")
    assert result.stdout.splitlines()[1].startswith("test,vit_small_patch16_224,1,4,")


def test_a_model_that_takes_any_size_is_not_rebuilt(tmp_path):
    _, result = _stats(tmp_path, TINY_CONVNEXT, 3, 96, 96)
    assert (result.exit_code, result.stderr) == (0, "")


@pytest.mark.parametrize("size, message", [
    ((3, 0, 64), "--input-size 3 0 64: height: input should be between 1 and 16384 (as the spec's input_size)"),
    ((3, 100, 100), "--input-size 3 100 100: the model cannot take it: its [16, 16] px patches do not divide "
                    "[100, 100]: timm would drop the last [4, 4] px of each side; give a multiple of the patch, "
                    "e.g. [96, 96]"),
])
def test_a_size_the_spec_would_refuse_is_refused_in_one_line(tmp_path, size, message):
    _, result = _stats(tmp_path, TINY_VIT, *size)
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"moespec: error: {message}\n")


def test_the_spec_refuses_a_patch_grid_that_drops_pixels_as_the_option_does(tmp_path):
    vit = {"model": "vit_small_patch16_224", "kwargs": {"depth": 2, "img_size": 100}}
    path = write(tmp_path, make_spec(vit, MOE, input_size=[3, 100, 100]).to_yaml())
    with pytest.raises(SpecError) as error:
        plan(load_spec(path))
    [problem] = error.value.problems
    assert problem.path == "input_size"
    assert "its [16, 16] px patches do not divide [100, 100]: timm would drop the last [4, 4] px" in problem.message

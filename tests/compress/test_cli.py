"""`moespec prune | merge | densify`: a checkpoint and an image folder in, a checkpoint and a report out; every
user mistake one line and exit 2."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import load_file
from typer.testing import CliRunner

import moespec
from moespec.cli import app

from .conftest import tiny_spec

runner = CliRunner()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("compress")
    moespec.save(moespec.create_model(tiny_spec(experts=4, top_k=2), seed=0), root / "moe.safetensors")
    rng = np.random.default_rng(0)
    (root / "images" / "a").mkdir(parents=True)
    for i in range(5):
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(root / "images" / "a" / f"{i}.png")
    (root / "empty").mkdir()
    return root


def invoke(*args: str):
    return runner.invoke(app, [*map(str, args)])


def test_prune_writes_a_checkpoint_of_the_new_spec(workspace, tmp_path):
    result = invoke("prune", workspace / "moe.safetensors", "--images", workspace / "images", "--keep", "3",
                    "-o", tmp_path / "p.safetensors")
    assert result.exit_code == 0, result.output
    assert "prune: on 5 images: top-1 agreement" in result.output and "tiny-prune3" in result.output
    assert "load before:" in result.output and f"wrote {tmp_path / 'p.safetensors'}" in result.output
    assert moespec.load(tmp_path / "p.safetensors").moespec_spec.moe[0].experts == 3
    again = invoke("prune", workspace / "moe.safetensors", "--images", workspace / "images", "--keep", "3",
                   "-o", tmp_path / "p.safetensors")
    assert again.exit_code == 2 and "exists" in again.output


@pytest.mark.slow
def test_merge_and_densify(workspace, tmp_path):
    merged = invoke("merge", workspace / "moe.safetensors", "--images", workspace / "images", "--into", "0.5",
                    "-o", tmp_path / "m.safetensors")
    assert merged.exit_code == 0, merged.output
    assert moespec.load(tmp_path / "m.safetensors").moespec_spec.moe[0].experts == 2
    dense = invoke("densify", tmp_path / "m.safetensors", "--images", workspace / "images",
                   "-o", tmp_path / "d.safetensors")
    assert dense.exit_code == 0, dense.output
    spec = tiny_spec()
    plain = timm.create_model(spec.backbone.model, **spec.backbone.kwargs)
    plain.load_state_dict(load_file(str(tmp_path / "d.safetensors")), strict=True)
    assert torch.equal(plain.eval()(torch.zeros(1, 3, 32, 32)),
                       moespec.load(tmp_path / "d.safetensors").eval()(torch.zeros(1, 3, 32, 32)))


@pytest.mark.parametrize("args, message", [
    (["--keep", "9"], "moespec: error: prune: keep 9 is more than the 4 experts of blocks.1.mlp (moe.0)"),
    (["--keep", "1"], "moespec: error: prune: keep 1 is fewer than the 2 experts each item uses in blocks.1.mlp"),
    (["--keep", "x"], "moespec: error: --keep 'x': give a number of experts (4) or a fraction of them (0.5)"),
    (["--keep", "2", "--images", "EMPTY"], "moespec: error: {root}/empty: no image files"),
])
def test_bad_input_is_one_line_and_exit_2(workspace, tmp_path, args, message):
    images = ["--images", workspace / "images"] if "--images" not in args else []
    args = [str(workspace / "empty") if a == "EMPTY" else a for a in args]
    result = invoke("prune", workspace / "moe.safetensors", *images, *args, "-o", tmp_path / "p.safetensors")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [message.format(root=workspace)] or \
        result.output.startswith(message.format(root=workspace))
    assert "Traceback" not in result.output and not (tmp_path / "p.safetensors").exists()


def test_a_checkpoint_that_does_not_match_its_spec_is_refused(workspace, tmp_path):
    (tmp_path / "other.yaml").write_text(tiny_spec(experts=6).to_yaml())
    result = invoke("prune", workspace / "moe.safetensors", "--spec", tmp_path / "other.yaml", "--images",
                    workspace / "images", "--keep", "2", "-o", tmp_path / "p.safetensors")
    assert result.exit_code == 2 and result.output.startswith("moespec: error: ")
    assert "Traceback" not in result.output


def test_layers_whose_experts_cannot_be_removed_say_why(workspace, tmp_path):
    spec = tiny_spec(experts=4).model_dump(mode="json")
    spec["moe"][0]["router"] = {"kind": "expert_choice"}
    (tmp_path / "ec.yaml").write_text(moespec.load_spec(spec).to_yaml())
    result = invoke("merge", tmp_path / "ec.yaml", "--images", workspace / "images", "--into", "2",
                    "-o", tmp_path / "m.safetensors")
    assert result.exit_code == 2
    assert result.output.startswith("moespec: error: merge: blocks.1.mlp (expert choice, moe.0) cannot be merged: "
                                    "each expert picks its own C = c*T/E items")


@pytest.mark.parametrize("command", ["prune", "merge", "densify"])
def test_the_output_options_are_compiles(command):
    import typer

    def params(name: str) -> dict:
        click_command = typer.main.get_command(app).commands[name]
        return {p.name: (p.opts, p.secondary_opts, p.help, p.default, p.required) for p in click_command.params}

    for name in ("output", "max_shard_size", "force"):
        assert params(command)[name] == params("compile")[name], name


def test_unreadable_calibration_files_are_reported_and_none_readable_is_exit_2(workspace, tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.png").write_bytes((workspace / "images" / "a" / "0.png").read_bytes())
    for i in range(20):
        (folder / f"x{i:02d}.png").write_bytes(b"not a png")
    result = invoke("prune", workspace / "moe.safetensors", "--images", folder, "--keep", "3",
                    "-o", tmp_path / "p.safetensors")
    assert result.exit_code == 0, result.output
    assert f"calibration: skipped 20 of 21 files in {folder} that are not readable images (first: " \
           f"{folder / 'x00.png'}: cannot identify image file" in result.output
    assert "prune: on 1 images" in result.output
    (folder / "a.png").write_bytes(b"not a png either")
    result = invoke("prune", workspace / "moe.safetensors", "--images", folder, "--keep", "3",
                    "-o", tmp_path / "q.safetensors")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.strip().splitlines() == [
        f"moespec: error: {folder}: no readable images (21 file(s) could not be read; first: {folder / 'a.png'}: "
        f"cannot identify image file '{folder / 'a.png'}')"]
    assert not (tmp_path / "q.safetensors").exists()

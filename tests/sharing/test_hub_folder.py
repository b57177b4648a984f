"""moespec writes the Hub layout itself (issue 48, point 3): `moespec.save_for_hf`, `moespec compile --hub` and
`moespec upcycle --hub` write a folder that timm and moespec load, with a model card, atomically: the old folder
or the new one whole, and nothing else in its parent touched."""

from __future__ import annotations

import json
import os

import pytest
import timm
import torch
from typer.testing import CliRunner

import moespec
import moespec.apps.hub_folder as hub_folder
from moespec.cli import app
from moespec.spec import hub_spec

from ..conftest import randomize

SPEC = """\
name: tiny-hub
backbone:
  model: vit_small_patch16_224
  kwargs: {depth: 2, embed_dim: 64, num_heads: 2, img_size: 32, patch_size: 8, num_classes: 3}
input_size: [3, 32, 32]
moe:
  - where: {every: 1}
    experts: 4
    router: {kind: topk, top_k: 2}
"""
LABELS = ["cat", "dog", "owl"]


def _model(tmp_path):
    (tmp_path / "spec.yaml").write_text(SPEC)
    return randomize(moespec.create_model(moespec.load_spec(tmp_path / "spec.yaml"), seed=0), seed=2).eval()


def _same_outputs(a, b):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(a.eval()(x), b.eval()(x), rtol=0, atol=0)


def test_save_for_hf_writes_a_folder_timm_and_moespec_load_with_a_model_card(tmp_path):
    model = _model(tmp_path)
    folder = moespec.save_for_hf(model, tmp_path / "hub", model_config={"label_names": LABELS})
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "model.safetensors"]
    loaded = timm.create_model(f"local-dir:{folder}", pretrained=True)
    _same_outputs(model, loaded)
    assert loaded.pretrained_cfg["label_names"] == LABELS
    _same_outputs(model, moespec.load(folder))
    _same_outputs(model, moespec.load(folder / "model.safetensors"))  # a moespec checkpoint too: spec in its header

    card = (folder / "README.md").read_text()
    record = moespec.stats(model.moespec_spec)
    assert "library_name: timm" in card and 'timm.create_model("hf-hub:ORG/NAME", pretrained=True)' in card
    assert "experts: 4" in card and "vit_small_patch16_224" in card  # the spec
    assert f"{record.total_params / 1e6:.2f}" in card and f"{record.activated_params / 1e6:.2f}" in card
    result = CliRunner().invoke(app, ["stats", str(folder), "--format", "json"])
    assert result.exit_code == 0 and f'"total_params": {record.total_params}' in result.output


def test_the_config_sizes_the_head_by_the_spec_not_by_model_args(tmp_path):
    """transformers' TimmWrapper passes `num_classes` beside the config's model_args, so the folder has none
    there (issue 63, point 4): the carried spec sizes the head, also one that `reset_classifier` changed after the
    build, with pretrained weights or without, and a new `num_classes` still fine-tunes from the folder."""
    model = _model(tmp_path)
    model.reset_classifier(5)
    randomize(model.head, seed=3)
    folder = moespec.save_for_hf(model, tmp_path / "hub")
    config = json.loads((folder / "config.json").read_text())
    assert "num_classes" not in config["model_args"] and config["num_classes"] == 5
    assert config["model_args"]["global_pool"] == "token" and "moespec" in config["model_args"]
    _same_outputs(model, timm.create_model(f"local-dir:{folder}", pretrained=True))
    assert timm.create_model(f"local-dir:{folder}").num_classes == 5
    assert moespec.load(folder).num_classes == 5
    assert hub_spec(folder).backbone.kwargs["num_classes"] == 5
    tuned = timm.create_model(f"local-dir:{folder}", pretrained=True, num_classes=2)
    assert tuned.num_classes == 2
    torch.testing.assert_close(tuned.blocks[1].mlp.experts.fc1.weight, model.blocks[1].mlp.experts.fc1.weight)


def test_an_existing_folder_is_replaced_whole_only_with_force(tmp_path, monkeypatch):
    model = _model(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("a sibling of the output")
    folder = tmp_path / "out" / "hub"
    moespec.save_for_hf(model, folder)
    first = (folder / "model.safetensors").read_bytes()
    with pytest.raises(moespec.MoespecError, match="already exists"):
        moespec.save_for_hf(model, folder)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hub_folder, "save_config_for_hf", broken)  # dies after the weights are written
    with pytest.raises(OSError):
        moespec.save_for_hf(randomize(model, seed=5), folder, force=True)
    assert (folder / "model.safetensors").read_bytes() == first  # the old folder, whole
    assert sorted(os.listdir(tmp_path / "out")) == ["hub", "keep.txt"]  # no temp folder left, nothing else touched
    monkeypatch.undo()
    moespec.save_for_hf(model, folder, force=True)
    assert sorted(os.listdir(tmp_path / "out")) == ["hub", "keep.txt"]
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "model.safetensors"]


def test_compile_and_upcycle_write_the_hub_layout(tmp_path, dense_checkpoint):
    (tmp_path / "spec.yaml").write_text(SPEC)
    spec = moespec.load_spec(tmp_path / "spec.yaml")
    dense_path, dense = dense_checkpoint(spec.backbone.model_dump())
    runner = CliRunner()
    result = runner.invoke(app, ["compile", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "compiled"), "--hub"])
    assert result.exit_code == 0, result.output
    assert "a Hub folder" in result.output
    assert len(moespec.moe_layers(timm.create_model(f"local-dir:{tmp_path / 'compiled'}", pretrained=True))) == 2
    result = runner.invoke(app, ["compile", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "compiled"), "--hub"])
    assert result.exit_code == 2 and "already exists" in result.output

    result = runner.invoke(app, ["upcycle", str(tmp_path / "spec.yaml"), str(dense_path), "-o",
                                 str(tmp_path / "upcycled"), "--hub"])
    assert result.exit_code == 0, result.output
    upcycled = timm.create_model(f"local-dir:{tmp_path / 'upcycled'}", pretrained=True).eval()
    _same_outputs(upcycled, moespec.upcycle(spec, checkpoint=dense_path, seed=0))  # the streamed weights
    assert sorted(os.listdir(tmp_path / "upcycled")) == ["README.md", "config.json", "model.safetensors"]


def test_force_replaces_only_a_hub_folder_moespec_wrote(tmp_path):
    """Issue 64, point 1: `--force` on a folder of the user's files (a project folder with its spec, a
    checkpoint, notes) refuses, and every file stays; a moespec Hub folder is still replaced."""
    model = _model(tmp_path)
    project = tmp_path / "proj"
    project.mkdir()
    files = {"s.yaml": SPEC, "notes.txt": "mine", "dense.safetensors": "weights"}
    for name, text in files.items():
        (project / name).write_text(text)
    with pytest.raises(moespec.MoespecError, match="did not write: it holds files a moespec Hub folder does not"):
        moespec.save_for_hf(model, project, force=True)
    assert {f.name: f.read_text() for f in project.iterdir()} == files
    fake = tmp_path / "fake"  # the Hub's file names, but not moespec's config
    fake.mkdir()
    (fake / "config.json").write_text('{"architecture": "resnet50"}')
    with pytest.raises(moespec.MoespecError, match="does not name moespec's architecture"):
        moespec.save_for_hf(model, fake, force=True)
    assert (fake / "config.json").read_text() == '{"architecture": "resnet50"}'
    hub = tmp_path / "hub"
    moespec.save_for_hf(model, hub)
    moespec.save_for_hf(randomize(model, seed=7), hub, force=True)  # moespec's own: replaced
    assert sorted(os.listdir(hub)) == ["README.md", "config.json", "model.safetensors"]


@pytest.mark.parametrize("output", [".", "", "..", "CWD", "/"])
def test_the_working_directory_is_never_an_output_folder(tmp_path, monkeypatch, output):
    """`-o .`, `-o ''`, `-o ..`, the working directory by name and `/`, with `--hub --force`: one error, exit 2
    (no internal error), and nothing in the working directory touched."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "spec.yaml").write_text(SPEC)
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    target = str(work) if output == "CWD" else output
    result = CliRunner().invoke(app, ["compile", "spec.yaml", "-o", target, "--hub", "--force"])
    assert result.exit_code == 2, result.output
    assert "internal error" not in result.output and ("working directory" in result.output
                                                      or "not a folder's name" in result.output), result.output
    assert sorted(os.listdir(work)) == ["notes.txt", "spec.yaml"]

"""Upcycling onto a new label set or resolution, as timm loads pretrained weights; timm training checkpoints."""

from __future__ import annotations

from argparse import Namespace

import pytest
import timm
import torch

import moespec
from moespec.errors import CheckpointError
from moespec.weights import read_state_dict

from ..conftest import make_spec, randomize

VIT_1000 = {"model": "vit_small_patch16_224", "kwargs": {"depth": 2, "img_size": 64}}  # timm's 1000 classes
VIT_7 = {"model": "vit_small_patch16_224", "kwargs": {"depth": 2, "img_size": 64, "num_classes": 7}}
MOE = [{"where": {"every": 1}, "experts": 4, "top_k": 2}]


def _body(state: dict) -> dict:
    return {k: v for k, v in state.items() if not k.startswith("head.") and ".mlp." not in k}


def test_a_1000_class_checkpoint_upcycles_into_a_7_class_spec_with_the_body_copied_exactly(dense_checkpoint):
    path, dense = dense_checkpoint(VIT_1000)
    spec = make_spec(VIT_7, MOE)
    model, report = moespec.weights.upcycle_with_report(spec, path)
    state = model.state_dict()
    for name, tensor in _body(dense.state_dict()).items():
        assert torch.equal(state[name], tensor), name
    for e in range(4):
        assert torch.equal(state["blocks.1.mlp.experts.fc1.weight"][e], dense.state_dict()["blocks.1.mlp.fc1.weight"])
    assert state["head.weight"].shape == (7, 384)
    assert "head: the checkpoint's (1000 classes) does not fit 7 classes; dropped, head freshly initialized" \
        in report.source
    assert model.head.weight.std() > 0  # timm's fresh init, not zeros from nowhere


def test_a_headless_checkpoint_is_fine(dense_checkpoint, tmp_path):
    _, dense = dense_checkpoint(VIT_7)
    path = tmp_path / "headless.pth"
    torch.save({k: v for k, v in dense.state_dict().items() if not k.startswith("head.")}, path)
    model, report = moespec.weights.upcycle_with_report(make_spec(VIT_7, MOE), path)
    assert "head: the checkpoint has none; head keeps its fresh init (7 classes)" in report.source
    assert torch.equal(model.state_dict()["pos_embed"], dense.state_dict()["pos_embed"])


def test_a_new_img_size_resamples_the_position_embedding_with_timms_filter(dense_checkpoint):
    path, dense = dense_checkpoint({"model": "vit_small_patch16_224", "kwargs": {"depth": 2, "img_size": 32,
                                                                                 "num_classes": 7}})
    spec = make_spec(VIT_7, MOE)  # 64 px: 16 patches instead of 4
    model, report = moespec.weights.upcycle_with_report(spec, path)
    assert model.pos_embed.shape == (1, 17, 384)
    assert "pos_embed resampled from [1, 5, 384] to [1, 17, 384] (timm's checkpoint filter)" in report.source
    expected = timm.layers.resample_abs_pos_embed(dense.pos_embed.detach(), (4, 4), num_prefix_tokens=1)
    torch.testing.assert_close(model.pos_embed.detach(), expected)


def test_register_timm_pretrained_with_another_num_classes(dense_checkpoint, tmp_path):
    path, _ = dense_checkpoint(VIT_1000)
    spec = make_spec(VIT_1000, MOE).model_copy()
    spec = spec.model_copy(update={"backbone": spec.backbone.model_copy(update={"checkpoint": str(path)})})
    name = moespec.register_timm(spec, name="moespec_test_fit_vit")
    model = timm.create_model(name, pretrained=True, num_classes=4)
    assert model.training and model.head.weight.shape == (4, 384)


def _training_checkpoint(tmp_path, spec):
    model = randomize(moespec.create_model(spec, seed=0), seed=1)
    ema = randomize(moespec.create_model(spec, seed=0), seed=2)
    path = tmp_path / "model_best.pth.tar"  # as timm's train.py saves it
    torch.save({"epoch": 3, "arch": "vit", "state_dict": model.state_dict(), "state_dict_ema": ema.state_dict(),
                "args": Namespace(lr=0.1), "metric": 71.5}, path)
    return path, model, ema


def test_timm_training_checkpoints_load_with_the_spec(tmp_path):
    spec = make_spec(VIT_7, MOE)
    path, model, ema = _training_checkpoint(tmp_path, spec)
    with pytest.raises(CheckpointError) as refused:
        moespec.load(path, spec=spec)
    assert "pass --trust-pickle" in str(refused.value) and "they hold the run's arguments" in str(refused.value)
    assert "truncated" not in str(refused.value)
    loaded = moespec.load(path, spec=spec, trust_pickle=True)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    loaded_ema = moespec.load(path, spec=spec, trust_pickle=True, ema=True)
    assert all(torch.equal(loaded_ema.state_dict()[k], v) for k, v in ema.state_dict().items())


def test_a_pickled_checkpoint_without_a_spec_says_to_give_one(tmp_path):
    path, _, _ = _training_checkpoint(tmp_path, make_spec(VIT_7, MOE))
    with pytest.raises(CheckpointError, match="a pickled checkpoint holds no spec; say which spec's model") as error:
        moespec.load(path)
    assert "truncated" not in str(error.value)


def test_a_plain_state_dict_without_ema_refuses_ema(tmp_path):
    spec = make_spec(VIT_7, MOE)
    path = tmp_path / "plain.pth"
    torch.save(moespec.create_model(spec).state_dict(), path)
    with pytest.raises(CheckpointError, match="has no EMA weights"):
        read_state_dict(path, ema=True)


CONVNEXT = {"model": "convnext_tiny", "kwargs": {"depths": [1, 1, 2, 1], "dims": [16, 32, 64, 128]}}
SWIN = {"model": "swin_tiny_patch4_window7_224",
        "kwargs": {"depths": [2, 2, 2, 2], "embed_dim": 16, "num_heads": [1, 2, 4, 8], "img_size": 64,
                   "window_size": 2}}


def test_a_checkpoint_of_another_family_names_the_files_own_keys_on_the_command_line(dense_checkpoint, tmp_path):
    """A Swin checkpoint into a ConvNeXt spec: timm's ConvNeXt filter fails on a Swin key (KeyError), which was
    an internal error (issue 52); it is one located error, exit 2, naming keys the file holds."""
    from typer.testing import CliRunner

    from moespec.cli import app

    path, _ = dense_checkpoint(SWIN, name="dense_swin.safetensors")
    spec_file = tmp_path / "convnext.yaml"
    spec_file.write_text(make_spec(CONVNEXT, [{"where": {"last": 1}, "experts": 4, "top_k": 1}]).to_yaml())
    result = CliRunner().invoke(app, ["upcycle", str(spec_file), "--checkpoint", str(path),
                                      "-o", str(tmp_path / "out.safetensors")])
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert lines[0] == (f"moespec: error: checkpoint {path} (keys as the file names them; a ConvNeXt is built) "
                        f"does not fit the backbone:")
    assert "unexpected keys: layers.0.blocks.0." in lines[2] and "missing keys: stem.0.weight" in lines[1]
    assert "internal error" not in result.output and not (tmp_path / "out.safetensors").exists()


def test_a_checkpoint_whose_filter_succeeds_but_does_not_fit_names_the_files_keys(tmp_path):
    """A ViT of depth 1 into a spec of depth 2: timm's ViT filter renames nothing, so the report is the plain
    one, with no note on the file's names."""
    small = timm.create_model("vit_small_patch16_224", depth=1, img_size=64, num_classes=7)
    path = tmp_path / "depth1.pth"
    torch.save(small.state_dict(), path)
    with pytest.raises(CheckpointError, match=rf"^checkpoint {path} does not fit the backbone:\n  \d+ missing "
                       r"keys: blocks.1.norm1.weight"):
        moespec.weights.upcycle_with_report(make_spec(VIT_7, MOE), path)

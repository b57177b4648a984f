"""`moespec inspect`: routing by class over a folder of synthetic labelled images, for every router kind."""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import zlib
from argparse import Namespace

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import moespec
from moespec.apps.inspect_report import write_report
from moespec.apps.inspection import class_order, data_transform, find_images, inspect_routing, load_model
from moespec.cli import app
from moespec.errors import MoespecError

SPEC = """\
# a tiny ViT with one MoE layer of each router kind
backbone: {model: vit_small_patch16_224, kwargs: {depth: 4, img_size: 64, num_classes: 10}}
input_size: [3, 64, 64]
moe:
  - where: {blocks: [0]}
    experts: 4
    top_k: 2
  - where: {blocks: [1]}
    experts: 3
    router: {kind: image}
  - where: {blocks: [2]}
    experts: 4
    router: {kind: soft}
  - where: {blocks: [3]}
    experts: 4
    router: {kind: expert_choice}          # last: it depends on the batch, the others on each image alone
"""
COLORS = {"red": (200, 40, 40), "green": (40, 180, 60), "blue": (40, 60, 200)}
PER_CLASS = 4


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A spec file and an ImageFolder of noisy single-colour images, 3 classes x 4 images (of other sizes
    than the model's, in two formats), plus a file that is not an image and one that is a broken PNG."""
    root = tmp_path_factory.mktemp("inspect")
    (root / "spec.yaml").write_text(SPEC)
    rng = np.random.default_rng(0)
    for name, colour in COLORS.items():
        folder = root / "images" / name
        folder.mkdir(parents=True)
        for i in range(PER_CLASS):
            pixels = np.clip(np.array(colour) + rng.normal(0, 30, (40, 48, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.{'png' if i % 2 else 'jpg'}")
    (root / "images" / "red" / "notes.txt").write_text("not an image")
    (root / "images" / "red" / "broken.png").write_bytes(b"not a png")
    return root


@pytest.fixture(scope="module")
def report(workspace):
    model = load_model(workspace / "spec.yaml")
    return inspect_routing(model, find_images(workspace / "images"), batch_size=5, source="spec.yaml"), model


def test_the_folder_is_read_as_an_image_folder(workspace):
    folder = find_images(workspace / "images")
    assert folder.classes == ("blue", "green", "red")
    assert [sum(1 for _, c in folder.files if c == i) for i in range(3)] == [4, 4, 5]  # broken.png counts here
    limited = find_images(workspace / "images", limit=2).files
    assert [len([1 for _, c in limited if c == i]) for i in range(3)] == [2] * 3


def test_shares_are_consistent_for_every_router_kind(report):
    result, model = report
    assert result.classes == ["blue", "green", "red"] and result.images_per_class == [4, 4, 4]
    assert len(result.skipped) == 1 and "broken.png" in result.skipped[0]
    assert result.data_config["input_size"] == [3, 64, 64]
    tokens_per_image = 17  # 16 patches + [CLS]
    tokens = [n * tokens_per_image for n in result.images_per_class]
    by_path = {layer.path: layer for layer in result.layers}
    assert [(layer.router, layer.unit) for layer in result.layers] == [
        ("topk", "token"), ("image", "image"), ("soft", "token"), ("expert_choice", "token")]

    topk = by_path["blocks.0.mlp"]  # dropless top-2: every token goes to two experts
    assert topk.items == sum(tokens) and topk.drop_fraction == 0
    for row in topk.share:
        assert sum(row) == pytest.approx(2.0)
    image = by_path["blocks.1.mlp"]  # image routing: whole images, one expert each
    assert image.items == 12 and image.drop_fraction == 0
    for row, images in zip(image.share, result.images_per_class, strict=True):
        assert sum(row) == pytest.approx(1.0)
        assert [share * images for share in row] == pytest.approx([round(share * images) for share in row])
    soft = by_path["blocks.2.mlp"]  # Soft MoE: combine weights, a distribution over experts per token
    for row in soft.share:
        assert sum(row) == pytest.approx(1.0) and min(row) > 0
    choice = by_path["blocks.3.mlp"]  # expert choice: each expert takes C = round(T / E) tokens of each image
    capacity = model.get_submodule("blocks.3.mlp").router.capacity
    assert sum(choice.load) == 12 * 4 * capacity(tokens_per_image)  # group: image, 12 images
    assert 0 < choice.drop_fraction < 1

    for layer in result.layers:  # the load is the class counts summed, and its shares sum to 1
        counts = [sum(share * n for share, n in zip(column, tokens, strict=True))
                  for column in zip(*layer.share, strict=True)]
        assert layer.load == pytest.approx(counts)
        assert sum(layer.load_share) == pytest.approx(1.0)
        assert sorted(layer.class_order) == [0, 1, 2]


@pytest.mark.slow  # 8 s: every image routed alone
def test_shares_and_experts_per_image_match_routing_each_image_alone(workspace, report):
    """Batching must not change the class attribution: route each image alone and count by hand. The same for
    seed 003's Table 5 figure: the distinct experts an image's tokens reach, averaged over the images."""
    result, model = report
    _, transform = data_transform(model)
    folder = find_images(workspace / "images")
    counts = {path: torch.zeros(3, model.get_submodule(path).num_experts, dtype=torch.float64)
              for path in ("blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp")}
    reached = []  # distinct experts of the top-2 layer per image
    for path, label in folder.files:
        if path.name == "broken.png":
            continue
        with torch.no_grad():
            model(transform(Image.open(path).convert("RGB")).unsqueeze(0))
        reached.append(int((model.get_submodule("blocks.0.mlp").last_routing.counts > 0).sum()))
        for name, total in counts.items():
            layer = model.get_submodule(name)
            if name == "blocks.2.mlp":
                total[label] += layer.last_combine[0].reshape(17, 4, 1).sum(dim=(0, 2)).double()
            else:
                total[label] += layer.last_routing.counts.double()
    by_path = {layer.path: layer for layer in result.layers}
    for name, total in counts.items():
        expected = total / (17 * torch.tensor([4.0, 4.0, 4.0], dtype=torch.float64)).unsqueeze(1)
        torch.testing.assert_close(torch.tensor(by_path[name].share, dtype=torch.float64), expected)
    assert by_path["blocks.0.mlp"].experts_per_image == pytest.approx(sum(reached) / 12)
    assert 2 <= by_path["blocks.0.mlp"].experts_per_image <= 4  # top-2 of 4 experts, 17 tokens
    assert by_path["blocks.1.mlp"].experts_per_image == 1  # image routing: k = 1
    assert by_path["blocks.2.mlp"].experts_per_image == 4  # Soft MoE: every expert
    assert 1 <= by_path["blocks.3.mlp"].experts_per_image <= 4
    assert result.experts_per_image == pytest.approx(sum(layer.experts_per_image for layer in result.layers))


def test_activated_parameters_per_image_by_hand(tmp_path):
    """A tiny ViT whose one MoE layer's router sees the same vector for every token (its block's norm2 has
    weight 0, bias 1), with logits 0.1 * 384 * e: every token of every image picks expert 3 (top-1), or 3 and 2
    (top-2). One expert (fc1 + fc2 of ViT-S, hidden 1536) holds 2 * 384 * 1536 + 1536 + 384 = 1,181,568
    parameters."""
    for name in ("a", "b"):
        (tmp_path / "images" / name).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(np.full((32, 32, 3), 60 * i + (100 if name == "a" else 0), np.uint8)).save(
                tmp_path / "images" / name / f"{i}.png")
    expert = 2 * 384 * 1536 + 1536 + 384
    for top_k in (1, 2):
        spec = moespec.load_spec({"backbone": {"model": "vit_small_patch16_224",
                                               "kwargs": {"depth": 2, "img_size": 32, "num_classes": 3}},
                                  "input_size": [3, 32, 32],
                                  "moe": [{"where": {"blocks": [1]}, "experts": 4, "top_k": top_k}]})
        model = moespec.create_model(spec).eval()
        with torch.no_grad():
            model.blocks[1].norm2.weight.zero_()
            model.blocks[1].norm2.bias.fill_(1.0)
            model.blocks[1].mlp.router.gate.weight.copy_(0.1 * torch.arange(4.0).unsqueeze(1).expand(4, 384))
        result = inspect_routing(model, find_images(tmp_path / "images"), batch_size=3)
        (layer,) = result.layers
        assert layer.params_per_expert == expert == 1_181_568
        assert layer.experts_per_image == result.experts_per_image == top_k
        total = sum(p.numel() for p in model.parameters())
        assert result.activated_params_per_image == total - 4 * expert + top_k * expert
        assert layer.share == [[0.0] * (4 - top_k) + [1.0] * top_k] * 2


@pytest.mark.slow  # DINOv2-S/14 built and run at 224 px: about 10 s
def test_activated_parameters_per_image_follow_vimoe_table_5(tmp_path):
    """ViMoE (seed 003), Table 5: token routing in DINOv2-S/14 with (N, L) = (8, 2) and a shared expert reaches
    14.3 experts and 38.9M parameters per image. Outside the routed experts: the dense model (its FFN replaced
    by the shared expert of the same size) and two routers, 22,013,800 + 2 * 384 * 8 = 22,019,944; one expert,
    2 * 384 * 1536 + 1536 + 384 = 1,181,568. So 22,019,944 + 14.3 * 1,181,568 = 38.92M, the paper's figure."""
    outside, expert = 22_013_800 + 2 * 384 * 8, 2 * 384 * 1536 + 1536 + 384
    assert round((outside + 14.3 * expert) / 1e6, 1) == 38.9
    (tmp_path / "images" / "a").mkdir(parents=True)
    for i in range(2):
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (224, 224, 3), np.uint8)).save(
            tmp_path / "images" / "a" / f"{i}.png")
    spec = moespec.load_spec({"backbone": {"model": "vit_small_patch14_dinov2",
                                           "kwargs": {"img_size": 224, "num_classes": 1000}},
                              "input_size": [3, 224, 224],
                              "moe": [{"where": {"last": 2}, "experts": 8, "shared_experts": 1,
                                       "router": {"kind": "topk", "top_k": 1}}]})
    result = inspect_routing(moespec.create_model(spec), find_images(tmp_path / "images"))
    assert [layer.params_per_expert for layer in result.layers] == [expert] * 2
    assert 2 <= result.experts_per_image <= 16
    assert result.activated_params_per_image == pytest.approx(outside + result.experts_per_image * expert)


def test_class_order_groups_classes_by_their_top_expert():
    share = [[0.1, 0.9, 0.0], [0.8, 0.2, 0.0], [0.0, 0.3, 0.7], [0.6, 0.4, 0.0], [0.2, 0.5, 0.3]]
    # top experts: 1, 0, 2, 0, 1 -> expert 0: classes 1 (0.8), 3 (0.6); expert 1: 0 (0.9), 4 (0.5); expert 2: 2
    assert class_order(share) == [1, 3, 0, 4, 2]


@pytest.mark.slow  # 10 s: the whole report, plots included
def test_the_report_folder(workspace, report, tmp_path):
    result, _ = report
    output = write_report(result, tmp_path / "report")
    summary = json.loads((output / "summary.json").read_text())
    assert summary["classes"] == result.classes and len(summary["layers"]) == 4
    page = (output / "index.html").read_text()
    for layer in summary["layers"]:
        assert layer["share"] == [list(row) for row in next(x.share for x in result.layers if x.path == layer["path"])]
        for name in layer["figures"].values():
            assert (output / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"src='{name}'" in page
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]  # no temp folder left behind
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(output.stat().st_mode) == 0o777 & ~umask  # not the private mode of a temp folder
    assert {stat.S_IMODE(p.stat().st_mode) for p in output.iterdir()} == {0o666 & ~umask}

    with pytest.raises(MoespecError, match="already exists and is not empty; pass --force"):
        write_report(result, output)
    (output / "stale.txt").write_text("from an older report")
    write_report(result, output, force=True)
    assert not (output / "stale.txt").exists() and (output / "index.html").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]


def test_a_checkpoint_routes_like_the_model_it_was_saved_from(workspace, report, tmp_path):
    result, model = report
    moespec.save(model, tmp_path / "model.safetensors")
    again = inspect_routing(load_model(tmp_path / "model.safetensors"), find_images(workspace / "images"), batch_size=5)
    assert [layer.share for layer in again.layers] == [layer.share for layer in result.layers]


def test_a_timm_training_checkpoint_routes_like_its_model_with_the_spec_given(workspace, report, tmp_path):
    """timm's train.py saves model_best.pth.tar: weights under state_dict, the run's arguments pickled."""
    result, model = report
    path = tmp_path / "model_best.pth.tar"
    torch.save({"epoch": 1, "state_dict": model.state_dict(), "args": Namespace(lr=0.1)}, path)
    with pytest.raises(moespec.CheckpointError, match="pass --trust-pickle"):
        load_model(path, spec=workspace / "spec.yaml")
    loaded = load_model(path, spec=workspace / "spec.yaml", trust_pickle=True)
    again = inspect_routing(loaded, find_images(workspace / "images"), batch_size=5)
    assert [layer.share for layer in again.layers] == [layer.share for layer in result.layers]


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("layout,message", [
    ("missing", "no such folder of images"),
    ("flat", "no class subfolders; expected one subfolder of images per class"),
    ("no_images", "no image files in its 2 class subfolder(s)"),
    ("unreadable", "no readable images (2 file(s) could not be read; first: "),
])
def test_bad_image_folders_are_clear_errors(workspace, tmp_path, layout, message):
    images = tmp_path / "images"
    if layout != "missing":
        images.mkdir()
    if layout == "flat":
        Image.new("RGB", (8, 8)).save(images / "a.png")
    for name in ("a", "b") if layout in ("no_images", "unreadable") else ():
        (images / name).mkdir()
        (images / name / ("x.png" if layout == "unreadable" else "x.txt")).write_bytes(b"junk")
    result = _cli("inspect", workspace / "spec.yaml", "--images", images, "-o", tmp_path / "out")
    assert result.exit_code == 2
    assert result.stderr.startswith("moespec: error: ") and message in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_a_dense_model_and_a_missing_source_are_clear_errors(workspace, tmp_path):
    (tmp_path / "dense.yaml").write_text("backbone: {model: vit_small_patch16_224, kwargs: {depth: 1, img_size: 32}}\n")
    result = _cli("inspect", tmp_path / "dense.yaml", "--images", workspace / "images", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "has no MoE layers; there is no routing to inspect" in result.stderr
    result = _cli("inspect", tmp_path / "nope.safetensors", "--images", workspace / "images", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "nope.safetensors: no such spec or checkpoint" in result.stderr


def test_without_matplotlib_inspect_names_the_extra(workspace, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    result = _cli("inspect", workspace / "spec.yaml", "--images", workspace / "images", "-o", tmp_path / "out")
    assert result.exit_code == 2
    assert result.stderr == ("moespec: error: moespec inspect needs matplotlib, which is not installed; "
                             "pip install 'moespec[plot]'\n")


@pytest.mark.slow
def test_inspect_command_end_to_end(workspace):
    argv = [sys.executable, "-m", "moespec.cli", "inspect", "spec.yaml", "--images", "images", "-o", "report",
            "--limit", "3", "--batch-size", "4"]
    run = subprocess.run(argv, cwd=workspace, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    wrote, per_image = run.stdout.splitlines()
    assert wrote == "wrote report/index.html (4 MoE layers, 9 images in 3 classes)"
    # --limit 3 leaves broken.png out; piped: one plain progress line per batch, no bar
    assert run.stderr.splitlines() == [f"moespec: routing images: {done}/3 {name}"
                                       for done, name in enumerate(("blue", "green", "red"), start=1)]
    summary = json.loads((workspace / "report" / "summary.json").read_text())
    assert summary["images_per_class"] == [3, 3, 3] and summary["source"] == "spec.yaml"
    assert per_image == (f"per image: {summary['experts_per_image']:.1f} experts (distinct, summed over the layers), "
                         f"{summary['activated_params_per_image'] / 1e6:.2f}M parameters")
    again = _cli("inspect", workspace / "spec.yaml", "--images", workspace / "images", "-o", workspace / "report")
    assert again.exit_code == 2 and again.stdout == ""
    assert again.stderr == (f"moespec: error: {workspace / 'report'} already exists and is not empty; pass --force "
                            "to replace it\n")


@pytest.mark.parametrize("where", ["images", "parent", "class"])
def test_the_report_folder_never_replaces_the_images_or_the_checkpoint(workspace, report, tmp_path, where):
    images = tmp_path / "data" / "images"
    shutil.copytree(workspace / "images", images)
    checkpoint = tmp_path / "data" / "model.safetensors"
    moespec.save(moespec.create_model(moespec.load_spec(workspace / "spec.yaml")), checkpoint)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    output = {"images": images, "parent": tmp_path / "data", "class": images / "red"}[where]
    result = _cli("inspect", checkpoint, "--images", images, "-o", output, "--force")
    assert result.exit_code == 2 and "a folder of its own" in result.stderr, result.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    with pytest.raises(MoespecError, match="a folder of its own"):  # the library refuses too
        write_report(report, tmp_path / "data", force=True, inputs=[images])
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def _claiming_size(path, width: int, height: int) -> None:
    """A 1x1 PNG whose header claims `width` x `height` pixels (with a valid CRC): Pillow sees the size on
    opening, before decoding anything, so the test never allocates the image."""
    Image.new("RGB", (1, 1)).save(path)
    data = bytearray(path.read_bytes())
    start = data.index(b"IHDR")  # chunk type, then 13 bytes of data, then the CRC of type + data
    data[start + 4:start + 12] = struct.pack(">II", width, height)
    data[start + 17:start + 21] = struct.pack(">I", zlib.crc32(bytes(data[start:start + 17])))
    path.write_bytes(bytes(data))


SMALL = """\
backbone: {model: vit_small_patch16_224, kwargs: {depth: 1, img_size: 32, embed_dim: 32, num_heads: 2, num_classes: 3}}
input_size: [3, 32, 32]
moe: [{where: {every: 1}, experts: 2, top_k: 1}]
"""
"""A one-block model, for the tests of reading images: building it is quick."""


@pytest.mark.parametrize("side", [20000, 12000], ids=["bomb_error", "bomb_warning"])
def test_a_decompression_bomb_is_a_clear_error_naming_the_image(workspace, tmp_path, side):
    images = tmp_path / "images"
    shutil.copytree(workspace / "images", images)
    _claiming_size(images / "green" / "huge.png", side, side)
    (tmp_path / "small.yaml").write_text(SMALL)
    result = _cli("inspect", tmp_path / "small.yaml", "--images", images, "-o", tmp_path / "out")
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith(f"moespec: error: {images / 'green' / 'huge.png'}: Image size "
                                    f"({side * side} pixels) exceeds limit") and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_one_channel_model_reads_grayscale_and_other_channel_counts_are_refused(workspace, tmp_path):
    gray = SMALL.replace("num_classes: 3}", "num_classes: 3, in_chans: 1}").replace("[3, 32, 32]", "[1, 32, 32]")
    (tmp_path / "gray.yaml").write_text(gray)
    model = load_model(tmp_path / "gray.yaml")
    config, transform = data_transform(model)
    mean, std = model.pretrained_cfg["mean"], model.pretrained_cfg["std"]
    assert config["mean"] == (sum(mean) / len(mean),) and config["std"] == (sum(std) / len(std),)
    with Image.open(workspace / "images" / "red" / "0.jpg") as image:
        assert transform(image.convert("L")).shape == (1, 32, 32)
    result = inspect_routing(model, find_images(workspace / "images", limit=1))
    assert result.images_per_class == [1, 1, 1] and result.input_size == (1, 32, 32)
    (tmp_path / "four.yaml").write_text(gray.replace("in_chans: 1", "in_chans: 4").replace("[1, 32", "[4, 32"))
    with pytest.raises(MoespecError, match=rf"^{tmp_path / 'four.yaml'}: the model takes 4-channel images .* "
                                           rf"RGB \(3 channels\) or grayscale \(1 channel\)"):
        data_transform(load_model(tmp_path / "four.yaml"))

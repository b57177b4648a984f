"""`backbone.pretrained: true`: timm's weights from the local cache with no network, and a one-line error at
once when they are not cached and the network is unreachable (issue 52: 22 lines of Hub retries over 52 s).
The network is made unreachable here (socket.create_connection refused), whatever this machine has."""

from __future__ import annotations

import errno
import logging
import socket

import pytest
import timm
import torch
from huggingface_hub import constants
from safetensors.torch import save_file

import moespec
from moespec.backbones import create_backbone
from moespec.errors import SpecError

from ..conftest import write

REPO = "timm/vit_small_patch16_224.augreg_in21k_ft_in1k"  # timm's default tag of vit_small_patch16_224
SPEC = ("name: pretrained\nbackbone:\n  model: vit_small_patch16_224\n  pretrained: true\n  kwargs: {depth: 1}\n"
        "input_size: [3, 224, 224]\nmoe:\n  - {where: {every: 1}, experts: 2}\n")


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """An empty Hub cache, and every TCP connection refused as on a machine without a network; the
    connections tried are recorded."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    tried = []

    def refuse(address, *args, **kwargs):
        tried.append(address)
        raise OSError(errno.ENETUNREACH, "Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", refuse)
    return tried


def test_without_a_network_pretrained_fails_at_once_with_one_line(no_network, tmp_path, caplog):
    spec = moespec.load_spec(write(tmp_path, SPEC))
    with caplog.at_level(logging.DEBUG), pytest.raises(SpecError) as error:
        create_backbone(spec, pretrained=True)
    [problem] = error.value.problems
    assert problem.path == "backbone.pretrained" and problem.line == 4
    assert problem.message.startswith("could not download timm's pretrained weights for 'vit_small_patch16_224' "
                                      "(Unreachable: not in the local cache, and cannot reach huggingface.co:443: "
                                      "Network is unreachable); with no network, save them")
    assert no_network == [("huggingface.co", 443)]  # one probe, and no download tried after it
    assert not [r for r in caplog.records if r.name.startswith("huggingface_hub") and r.levelno >= logging.WARNING]
    assert constants.HF_HUB_OFFLINE is False  # the offline mode was for the cache read only


def test_the_command_line_says_it_in_one_line_exit_2(no_network, tmp_path):
    from typer.testing import CliRunner

    from moespec.cli import app

    spec_file = write(tmp_path, SPEC)
    result = CliRunner().invoke(app, ["upcycle", str(spec_file), "-o", str(tmp_path / "out.safetensors")])
    assert result.exit_code == 2
    [line] = result.output.splitlines()
    assert line.startswith(f"moespec: error: {spec_file}:4:3: backbone.pretrained: could not download timm's "
                           f"pretrained weights")


def test_weights_in_the_local_cache_are_read_with_no_network(no_network, tmp_path):
    """A Hub cache laid out as huggingface_hub keeps it (refs/main -> snapshots/<commit>/model.safetensors),
    holding a depth-1 ViT-S: the backbone gets those weights, and no connection is tried."""
    dense = timm.create_model("vit_small_patch16_224", depth=1)
    folder = tmp_path / "hub" / f"models--{REPO.replace('/', '--')}"
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "snapshots" / commit).mkdir(parents=True)
    save_file(dense.state_dict(), str(folder / "snapshots" / commit / "model.safetensors"))
    built = create_backbone(moespec.load_spec(write(tmp_path, SPEC)), pretrained=True)
    for name, tensor in dense.state_dict().items():
        assert torch.equal(built.state_dict()[name], tensor), name
    assert no_network == []

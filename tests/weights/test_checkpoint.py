"""moespec checkpoints: the spec travels in the file; writes are atomic and never clobber by accident."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open

import moespec
from moespec.errors import CheckpointError, MoespecError
from moespec.weights import SPEC_HASH_KEY, SPEC_KEY, VERSION_KEY, read_spec

from ..conftest import TINY_CONVNEXT, TINY_INPUT, TINY_VIT, make_spec

SPEC = [{"where": {"every": 2}, "experts": 4, "top_k": 2, "shared_experts": 1}]


def test_save_load_round_trip(tmp_path):
    spec = make_spec(TINY_VIT, SPEC)
    model = moespec.create_model(spec)
    path = moespec.save(model, tmp_path / "moe.safetensors")
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    assert metadata[VERSION_KEY] == moespec.__version__
    assert moespec.load_spec("x.yaml", text=metadata[SPEC_KEY]).model_dump() == spec.model_dump()
    loaded = moespec.load(path)
    x = torch.randn(2, *TINY_INPUT)
    assert torch.equal(loaded(x), model(x))
    assert loaded.moespec_spec.model_dump() == spec.model_dump()
    assert [p.name for p in tmp_path.iterdir()] == ["moe.safetensors"]  # no stray temp file


@pytest.mark.parametrize("backbone,pool", [(TINY_VIT, "avg"), (TINY_CONVNEXT, "max")], ids=["vit", "convnext"])
def test_the_saved_spec_follows_reset_classifier(backbone, pool, tmp_path):
    """After timm's `reset_classifier` (a fine-tune's new head, or pooling) the checkpoint's spec builds the model
    it holds: the head's size and pooling, not the build's. The spec embedded the build's 10 classes, and
    `load` refused the 5-class head; the model's own spec is left as built."""
    spec = make_spec(backbone, SPEC)
    x = torch.randn(2, *TINY_INPUT)
    for args in (5,), (3, pool):
        model = moespec.create_model(spec, seed=0).eval()
        model.reset_classifier(*args)
        loaded = moespec.load(moespec.save(model, tmp_path / "moe.safetensors", force=True)).eval()
        with torch.no_grad():
            assert loaded(x).shape == (2, args[0])
            torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
        assert model.moespec_spec is spec
    assert read_spec(tmp_path / "moe.safetensors").backbone.kwargs["num_classes"] == 3


def test_existing_output_needs_force(tmp_path):
    model = moespec.create_model(make_spec(TINY_VIT, SPEC))
    path = tmp_path / "moe.safetensors"
    path.write_bytes(b"keep me")
    with pytest.raises(MoespecError, match="already exists; pass --force"):
        moespec.save(model, path)
    assert path.read_bytes() == b"keep me"
    moespec.save(model, path, force=True)
    assert moespec.load(path) is not None


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    model = moespec.create_model(make_spec(TINY_VIT, SPEC))

    def explode(*args, **kwargs):
        with open(args[0], "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr("moespec.io.writer.write_safetensors", explode)
    with pytest.raises(MoespecError, match="moe.safetensors: cannot write it \\(disk full\\)"):
        moespec.save(model, tmp_path / "moe.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_dense_or_altered_files_are_refused(tmp_path, dense_checkpoint):
    dense_path, _ = dense_checkpoint(TINY_VIT)
    with pytest.raises(CheckpointError, match="has no moespec spec in its metadata"):
        moespec.load(dense_path)

    path = moespec.save(moespec.create_model(make_spec(TINY_VIT, SPEC)), tmp_path / "moe.safetensors")
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + size])
    header["__metadata__"][SPEC_KEY] = header["__metadata__"][SPEC_KEY].replace("experts: 4", "experts: 5")
    assert header["__metadata__"][SPEC_HASH_KEY]
    blob = json.dumps(header).encode()
    altered = tmp_path / "altered.safetensors"
    altered.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + size :])
    with pytest.raises(CheckpointError, match="does not match its hash"):
        read_spec(altered)

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError):
        moespec.load(truncated)

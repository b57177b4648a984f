"""Reading a checkpoint costs what its file can back: a file too small for the model its spec describes is
refused before the model is built, and a pickled checkpoint's zip records are not inflated past its size."""

from __future__ import annotations

import os
import sys
import zipfile

import pytest
import torch

import moespec
from moespec.errors import CheckpointError
from moespec.io import write_safetensors
from moespec.weights import checkpoint, read_state_dict, spec_metadata

from ..conftest import TINY_VIT, make_spec, measured_run

HUGE = [{"where": {"every": 1}, "experts": 512, "router": {"top_k": 2}}]  # 2 x 512 x 1.2M: 4.8 GB of experts


def tiny_file_of_a_huge_spec(tmp_path):
    """A moespec checkpoint of about a kilobyte: the spec of a 1.2B-parameter model, and no tensors."""
    path = tmp_path / "huge.safetensors"
    write_safetensors(path, [], lambda info: None, spec_metadata(make_spec(TINY_VIT, HUGE)))
    return path


def test_a_checkpoint_too_small_for_its_spec_is_refused_before_any_real_build(tmp_path, monkeypatch):
    """`inspect` of a 908-byte checkpoint whose spec describes a huge model built it first (2.6 GB, 18 s)."""
    path = tiny_file_of_a_huge_spec(tmp_path)
    assert path.stat().st_size < 4096
    built = []
    create = checkpoint.create_model
    monkeypatch.setattr(checkpoint, "create_model", lambda spec, **kw: built.append(kw) or create(spec, **kw))
    with pytest.raises(CheckpointError, match="does not fit the backbone") as error:
        moespec.load(path)
    assert "missing keys" in str(error.value)
    assert built == [{"device": "meta"}]


@pytest.mark.slow  # 6.5 s: the refusal timed and measured in a subprocess (CI runs it)
def test_the_refusal_is_measured_in_seconds_and_megabytes(tmp_path):
    path = tiny_file_of_a_huge_spec(tmp_path)
    code = (f"import moespec\ntry:\n    moespec.load({str(path)!r})\nexcept moespec.errors.CheckpointError as e:\n"
            f"    print(str(e).splitlines()[0])\n")
    env = {**os.environ, "MOESPEC_CACHE_DIR": str(tmp_path / "cache")}
    exit_code, stdout, stderr, seconds, peak_kb = measured_run([sys.executable, "-c", code], timeout=120, env=env)
    assert (exit_code, stdout) == (0, f"{path} does not fit the backbone:\n"), stderr
    assert peak_kb < 1_500_000, peak_kb  # the model alone is 4.8 GB; torch and timm take ~0.5 GB


def test_a_zip_record_that_inflates_past_the_file_is_refused_unread(tmp_path, monkeypatch):
    """A 1.9 MB .pth whose record inflated to 2 GB was inflated in memory (2.7 GB RSS) before it was refused."""
    plain = tmp_path / "plain.pth"
    torch.save({"weight": torch.zeros(4 * 1024 * 1024)}, plain)  # 16 MB of zeros, stored
    bomb = tmp_path / "bomb.pth"
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as target:
        for record in source.infolist():
            target.writestr(record.filename, source.read(record))
    assert bomb.stat().st_size * 100 < plain.stat().st_size
    assert read_state_dict(plain)["weight"].shape == (4 * 1024 * 1024,)
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: pytest.fail("torch.load inflated it"))
    with pytest.raises(CheckpointError, match=r"its zip records inflate to 16,7\d\d,\d\d\d bytes") as error:
        read_state_dict(bomb)
    assert "torch.save stores tensors uncompressed" in str(error.value) and len(str(error.value)) < 300

"""Output names a checkpoint write refuses before it touches anything (issue 37): the index path that
`compile` printed, a suffix that is not .safetensors, a name with a newline or bytes that are not UTF-8.
One `moespec: error:` line, exit 2, the folder as it was."""

from __future__ import annotations

import os

import pytest
import torch
from typer.testing import CliRunner

import moespec
from moespec.cli import app
from moespec.errors import MoespecError
from moespec.io import TensorInfo, write_sharded

from ..conftest import TINY_VIT, make_spec

SPEC = [{"where": {"every": 1}, "experts": 2, "top_k": 1}]


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _one_error_line(result, *needles):
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("moespec: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert all(needle in result.stderr for needle in needles), result.stderr


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(make_spec(TINY_VIT, SPEC).to_yaml())
    return path


def test_the_index_path_as_output_is_refused_before_anything_changes(spec_file, tmp_path):
    """`-o m.safetensors.index.json --force` (the path `compile` prints for a sharded output) once deleted the
    old index and wrote shards named `m.safetensors.index.json-0000i-of-...`; now it names the base path."""
    base = tmp_path / "m.safetensors"
    write_sharded(base, [TensorInfo(f"t{i}", (100,), torch.float32) for i in range(4)],
                  lambda info: torch.ones(info.shape), {}, max_shard_size=400)
    index = tmp_path / "m.safetensors.index.json"
    before = _snapshot(tmp_path)
    for command in ("compile", "upcycle"):
        for force in ([], ["--force"]):
            result = _cli(command, spec_file, "-o", index, *force)
            _one_error_line(result, f"{index} is the index of a sharded checkpoint; name the output by its base "
                                    f"path, {base}")
    with pytest.raises(MoespecError, match="is the index of a sharded checkpoint"):
        moespec.save(_model(), index, force=True)
    assert _snapshot(tmp_path) == before


def _model() -> torch.nn.Module:
    """A model `save` takes, without the cost of building one: any module with a spec attached."""
    model = torch.nn.Linear(2, 2)
    model.moespec_spec = make_spec(TINY_VIT, SPEC)
    return model


@pytest.mark.parametrize("name", ["model.bin", "model.pth", "model", "sub/model.pt", "model.safetensors.json"])
def test_an_output_that_is_not_named_safetensors_is_refused_and_nothing_is_written(spec_file, tmp_path, name):
    """`compile -o model.bin` wrote safetensors under a pickle suffix (exit 0), which `inspect` then took for
    a pickle. Refused, and not even the output's folder is created."""
    output = tmp_path / name
    for command in ("compile", "upcycle"):
        result = _cli(command, spec_file, "-o", output, "--force")
        _one_error_line(result, f"{output}: a moespec checkpoint is a safetensors file; name the output "
                                f"NAME.safetensors")
    with pytest.raises(MoespecError, match="a moespec checkpoint is a safetensors file"):
        moespec.save(_model(), output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


@pytest.mark.parametrize("name", ["a\nb.safetensors", "a\rb.safetensors", os.fsdecode(b"caf\xe9.safetensors")],
                         ids=["newline", "return", "latin-1"])
def test_an_output_name_that_cannot_be_shown_on_one_line_is_refused_before_writing(spec_file, tmp_path, name):
    output = tmp_path / name
    for command in ("compile", "upcycle"):
        result = _cli(command, spec_file, "-o", output)
        _one_error_line(result, "the output's name holds")
    result = _cli("inspect", spec_file, "--images", tmp_path, "-o", tmp_path / name.replace(".safetensors", ""))
    _one_error_line(result, "the output's name holds")
    with pytest.raises(MoespecError, match="the output's name holds"):
        moespec.save(_model(), output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]

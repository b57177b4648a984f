"""Specs that are too much, or not text: alias bombs, deep nesting, huge or unreadable files, bytes that are
not UTF-8 are refused as a `SpecError` at the file (and line), never expanded, read or crashed on; in a
folder batch the other specs are still reported.

The corpus (`tests/data/bad_specs`: yaml_alias_bomb, yaml_recursive_alias, yaml_nested_too_deep, not_utf8)
checks the CLI's message for each; these tests check what the corpus cannot.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file
from typer.testing import CliRunner

from moespec import SpecError, load_spec
from moespec.cli import app
from moespec.spec.yaml_limits import MAX_SPEC_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES, BoundedLoader
from moespec.weights import SPEC_HASH_KEY, SPEC_KEY
from moespec.weights.checkpoint import read_spec

from ..conftest import SPECS_DIR, TINY_SPEC_YAML

BAD_SPECS = Path(__file__).parent.parent / "data" / "bad_specs"
BOMB = (BAD_SPECS / "yaml_alias_bomb.yaml").read_text(encoding="utf-8")
BOMB_ALIAS_LINE = 8  # the first alias that takes the document past the budget: 9**4 values behind it


def problem_of(source, **kwargs):
    with pytest.raises(SpecError) as info:
        load_spec(source, **kwargs)
    assert len(info.value.problems) == 1, str(info.value)
    return info.value.problems[0]


def test_shipped_specs_are_far_within_the_limits():
    for path in SPECS_DIR.glob("*.yaml"):
        text = path.read_text(encoding="utf-8")
        loader = BoundedLoader(text)
        loader.get_single_node()
        assert loader._values * 10 < MAX_YAML_NODES and len(text.encode()) * 100 < MAX_SPEC_BYTES, path


def test_an_alias_bomb_is_refused_at_its_alias_before_anything_is_constructed(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a refused document was constructed")

    monkeypatch.setattr(yaml.SafeLoader, "construct_document", never)
    problem = problem_of("model.safetensors[spec]", text=BOMB)  # a checkpoint's embedded spec
    assert (problem.file, problem.line, problem.column) == ("model.safetensors[spec]", BOMB_ALIAS_LINE, 10)
    assert f"past {MAX_YAML_NODES:,} values" in problem.message


def test_an_alias_bomb_embedded_in_a_checkpoint_is_refused(tmp_path):
    path = tmp_path / "bomb.safetensors"
    save_file({"w": torch.zeros(1)}, str(path),
              metadata={SPEC_KEY: BOMB, SPEC_HASH_KEY: hashlib.sha256(BOMB.encode()).hexdigest()})
    with pytest.raises(SpecError, match=rf"^{path}\[spec\]:{BOMB_ALIAS_LINE}:10: the alias \*a3 takes the spec past"):
        read_spec(path)


def test_aliases_within_the_budget_still_load():
    text = ("kwargs: &kwargs {depth: 2, img_size: 64, num_classes: 10}\n"
            "backbone: {model: vit_small_patch16_224, kwargs: *kwargs}\n"
            "moe: [{where: &last {last: 1}, experts: 2}, {where: *last, experts: 2, sublayer: norm}]\n")
    problems = [str(p) for p in pytest.raises(SpecError, load_spec, "s.yaml", text=text).value.problems]
    assert problems == ["s.yaml:1:1: kwargs: unknown key 'kwargs'; allowed: name, backbone, input_size, rescale, moe, "
                        "upcycle, aux_loss_in_backward, aux_loss_backward_scale"]


def test_aliases_count_at_their_expanded_depth():
    nest = "[" * (MAX_YAML_DEPTH // 2) + "1" + "]" * (MAX_YAML_DEPTH // 2)
    text = f"a: &a {nest}\nb: &b {nest.replace('1', '*a')}\nbackbone: {{model: m}}\n"
    problem = problem_of("s.yaml", text=text)
    assert (problem.line, problem.message.split(" nests")[0]) == (2, "the alias *a")


def test_a_spec_file_over_the_size_limit_is_refused(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(TINY_SPEC_YAML + "#" * MAX_SPEC_BYTES + "\n", encoding="utf-8")
    problem = problem_of(path)
    assert (problem.file, problem.line) == (str(path), None)
    assert problem.message.startswith(f"the spec file is larger than {MAX_SPEC_BYTES:,} bytes")
    assert problem_of("x[spec]", text="#" * (MAX_SPEC_BYTES + 1)).message.startswith("the spec is larger than")
    assert problem_of("x[spec]", text="#é" * (MAX_SPEC_BYTES // 3 + 1)).message.startswith("the spec is larger")


def test_bytes_that_are_not_utf8_are_located(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("backbone:\n  model: vit_small_patch16_224\nname: caf".encode() + b"\xe9\n")
    problem = problem_of(path)
    assert (problem.line, problem.column) == (3, 10)
    assert problem.message == "not UTF-8 text: byte 0xe9 cannot be decoded; save the spec file as UTF-8"


def test_unreadable_spec_files_are_spec_errors(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.symlink_to(tmp_path / "absent.yaml")
    assert problem_of(broken).message == "no such spec file (a broken symbolic link)"
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # opening it would block
    assert problem_of(fifo).message == "not a regular file (a fifo, socket or device); name a spec file"


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux's /proc/self/mem")
def test_a_read_error_is_a_spec_error(tmp_path):
    """An I/O error while reading (also as root, who may read a chmod 000 file): /proc/self/mem is a regular
    file that cannot be read at offset 0."""
    path = tmp_path / "eio.yaml"
    path.symlink_to("/proc/self/mem")
    assert problem_of(path).message == "cannot read the spec file: Input/output error"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads a chmod 000 file")
def test_a_file_without_read_permission_is_a_spec_error(tmp_path):
    path = tmp_path / "secret.yaml"
    path.write_text(TINY_SPEC_YAML, encoding="utf-8")
    path.chmod(0)
    assert problem_of(path).message == "cannot read the spec file: Permission denied"
    path.chmod(0o600)
    tmp_path.chmod(0)  # not even its kind can be told
    try:
        assert problem_of(path).message == "cannot read the spec file: Permission denied"
    finally:
        tmp_path.chmod(0o700)


def test_a_folder_batch_reports_every_unreadable_spec_and_validates_the_others(tmp_path):
    (tmp_path / "good.yaml").write_text(TINY_SPEC_YAML, encoding="utf-8")
    (tmp_path / "latin1.yaml").write_bytes(b"name: caf\xe9\n")
    (tmp_path / "bomb.yaml").write_text(BOMB, encoding="utf-8")
    (tmp_path / "deep.yaml").write_text("backbone: " + "[" * 10_000 + "]" * 10_000 + "\n", encoding="utf-8")
    (tmp_path / "broken.yaml").symlink_to(tmp_path / "absent.yaml")
    os.mkfifo(tmp_path / "fifo.yaml")
    result = CliRunner().invoke(app, ["validate", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert result.stdout.startswith(f"ok: {tmp_path / 'good.yaml'} ")
    errors = result.stderr.splitlines()
    assert [line.split(": ")[2].split(":")[0] for line in errors] == [
        str(tmp_path / name) for name in ("bomb.yaml", "broken.yaml", "deep.yaml", "fifo.yaml", "latin1.yaml")]
    assert all(line.startswith("moespec: error: ") for line in errors)

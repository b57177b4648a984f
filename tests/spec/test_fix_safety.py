"""`moespec validate --fix` on a file someone is editing, and on every form the previous release wrote (issue
47): it rewrites only the file it read (same content and inode at the rename), keeps every comment and the
line endings, edits a symbolic link's target, never splits hard links, fixes `Spec.to_yaml` output of release
0.1, and says in one line, exit 2, what it cannot do."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

import moespec
import moespec.io.atomic as atomic
import moespec.spec.loading
from moespec.cli import app
from moespec.routers.image import ImageRouterSpec
from moespec.routers.topk import TopKRouterSpec

from ..conftest import TINY_VIT

ROOT = Path(__file__).parents[2]
HEAD = ("backbone: {model: vit_small_patch16_224, kwargs: {depth: 2, img_size: 32, embed_dim: 32, num_heads: 2}}\n"
        "input_size: [3, 32, 32]\nmoe:\n  - where: {every: 1}\n    experts: 4\n")
OLD = HEAD + "    top_k: 2  # two experts\n    router: {kind: topk}\n"
NEW = HEAD + "    router: {kind: topk, top_k: 2}  # two experts\n"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESPEC_CACHE_DIR", str(tmp_path / "cache"))


def _fix(path: Path):
    result = CliRunner().invoke(app, ["validate", "--fix", str(path)])
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    return result


def _write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode())
    return path


def test_every_comment_is_kept():
    """A comment after `top_k:` with the value on the next line, and a moved key's comment when the router's
    line has one, were dropped."""
    from moespec.spec.compat import upgraded_text

    old = HEAD + "    top_k:  # two experts\n      2\n    capacity_factor: 1.5  # some drops\n" \
                 "    router: {kind: topk}  # the router\n"
    assert upgraded_text(old) == HEAD + ("    router: {kind: topk, top_k: 2, capacity_factor: 1.5}  # the router  "
                                         "# two experts; # some drops\n")
    block = HEAD + "    top_k:\n      # two experts\n      2\n    router:\n      kind: topk  # the router\n"
    assert upgraded_text(block) == HEAD + "    router:\n      kind: topk  # the router\n" \
                                          "      top_k: 2  # two experts\n"


@pytest.mark.parametrize("router", ["    router: {kind: topk}  # r\n", "    router:\n      kind: topk\n", ""])
def test_a_crlf_file_keeps_its_line_endings(tmp_path, router):
    """--fix of a CRLF file mixed line endings."""
    path = _write(tmp_path, (HEAD + "    top_k: 2  # k\n" + router).replace("\n", "\r\n"))
    assert _fix(path).exit_code == 0
    data = path.read_bytes()
    assert b"top_k: 2" in data and data.count(b"\n") == data.count(b"\r\n") and b"\r\r" not in data
    assert b"\r\n    top_k: 2  # k" not in data  # moved


def test_release_0_1s_own_to_yaml_is_fixed(tmp_path):
    """--fix of the spec release 0.1's `Spec.to_yaml` wrote (into its checkpoints) blamed a key the file does
    not have: it moved `capacity_factor: null` into an image router."""
    with open(ROOT / "tests" / "data" / "release_0_1" / "tiny.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    path = _write(tmp_path, header["__metadata__"]["moespec.spec"])
    before = moespec.load_spec(path)
    result = _fix(path)
    assert result.exit_code == 0, result.output
    assert moespec.load_spec(path).model_dump() == before.model_dump()
    assert "group: null\n    pool" not in path.read_text()  # the image router's stale `group: null` is gone
    assert "note" not in CliRunner().invoke(app, ["validate", str(path)]).stderr


def test_an_edit_saved_while_fix_reads_is_kept(tmp_path, monkeypatch):
    """--fix overwrote an edit saved between its read and its rename."""
    path = _write(tmp_path, OLD)
    upgraded = moespec.spec.loading.upgraded_spec_text

    def editor_saves_meanwhile(*args, **kwargs):
        new = upgraded(*args, **kwargs)
        path.write_text(OLD + "# the user's edit\n")  # in place: same inode, other content
        return new

    monkeypatch.setattr(moespec.spec.loading, "upgraded_spec_text", editor_saves_meanwhile)
    result = _fix(path)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"moespec: error: {path}: changed while it was being rewritten")
    assert path.read_text() == OLD + "# the user's edit\n"


def test_an_edit_saved_by_a_rename_is_kept(tmp_path, monkeypatch):
    """The same text saved as a new file (an editor's write and rename) is another file: left as it is."""
    path = _write(tmp_path, OLD)
    upgraded = moespec.spec.loading.upgraded_spec_text

    def editor_renames(*args, **kwargs):
        new = upgraded(*args, **kwargs)
        _write(tmp_path, OLD, "saved.tmp").rename(path)
        return new

    monkeypatch.setattr(moespec.spec.loading, "upgraded_spec_text", editor_renames)
    assert _fix(path).exit_code == 2
    assert path.read_text() == OLD


def test_an_edit_saved_at_the_rename_is_put_back(tmp_path, monkeypatch):
    """An edit that lands after the last check, as the new file is swapped in, is swapped back."""
    path = _write(tmp_path, OLD)
    exchange, calls = atomic._exchange, []

    def edit_then_swap(a, b):
        if not calls:
            path.write_text(OLD + "# the user's edit\n")
        calls.append((a, b))
        return exchange(a, b)

    monkeypatch.setattr(atomic, "_exchange", edit_then_swap)
    result = _fix(path)
    assert result.exit_code == 2 and "changed while it was being rewritten" in result.stderr
    assert path.read_text() == OLD + "# the user's edit\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "spec.yaml"]


def test_a_symlinked_spec_is_fixed_in_the_file_it_names(tmp_path):
    """--fix replaced a symbolic link with a fixed copy; the shared file stayed old."""
    real = _write(tmp_path, OLD, "shared.yaml")
    link = tmp_path / "mine.yaml"
    link.symlink_to(real)
    result = _fix(link)
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and real.read_text() == NEW
    assert f"moespec: fixed: {link} (the file it links to, {real}): moe.0.top_k" in result.stderr


def test_a_hard_linked_spec_is_refused_and_left_whole(tmp_path):
    real = _write(tmp_path, OLD, "shared.yaml")
    os.link(real, tmp_path / "mine.yaml")
    result = _fix(tmp_path / "mine.yaml")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"moespec: error: {tmp_path / 'mine.yaml'}: has 2 names (hard links)")
    assert real.read_text() == OLD and os.path.samefile(real, tmp_path / "mine.yaml")


def test_a_read_only_spec_is_refused(tmp_path):
    path = _write(tmp_path, OLD)
    path.chmod(0o444)
    result = _fix(path)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "read-only; --fix changes only a file you may write" in result.stderr
    assert path.read_text() == OLD


@pytest.mark.parametrize("failure", ["another user's, in a sticky folder", "a full disk"])
def test_a_write_that_fails_is_one_error_and_leaves_the_file(tmp_path, monkeypatch, failure):
    """--fix of another user's file in a sticky folder, or on a full disk, was an internal error."""
    path = _write(tmp_path, OLD)
    if failure == "a full disk":
        def full(fd):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(atomic.os, "fsync", full)
        expected = "cannot replace it (no space left on the device); it is as it was"
    else:
        def not_permitted(*args):
            raise PermissionError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(atomic, "_exchange", not_permitted)
        monkeypatch.setattr(atomic.os, "replace", not_permitted)
        expected = "cannot replace it (Operation not permitted); it is as it was"
    result = _fix(path)
    monkeypatch.undo()
    assert result.exit_code == 2 and result.stderr == f"moespec: error: {path}: {expected}\n"
    assert path.read_text() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "spec.yaml"]


def test_a_router_shared_by_an_alias_is_refused_with_its_line(tmp_path):
    """--fix of a group whose router is another group's (&r / *r) was an internal error."""
    text = HEAD.replace("every: 1", "blocks: [0]") + "    router: &r {kind: topk}\n" \
        "  - where: {blocks: [1]}\n    experts: 4\n    top_k: 2\n    router: *r\n"
    path = _write(tmp_path, text)
    result = _fix(path)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"moespec: error: {path}: cannot move moe.1.top_k into the router")
    assert "line 10: this group's router is also another group's" in result.stderr
    assert path.read_text() == text


def test_a_router_spec_object_with_old_group_keys_is_merged_or_refused_like_a_mapping():
    """`router: TopKRouterSpec()` beside the group's old `top_k: 2, capacity_factor: 1.5` dropped both."""
    group = {"where": {"every": 1}, "experts": 4, "top_k": 2, "capacity_factor": 1.5}
    spec = moespec.load_spec({"backbone": TINY_VIT, "moe": [{**group, "router": TopKRouterSpec(normalize=True)}]})
    router = spec.moe[0].router
    assert (router.top_k, router.capacity_factor, router.normalize) == (2, 1.5, True)
    as_mapping = moespec.load_spec({"backbone": TINY_VIT, "moe": [{**group, "router": {"normalize": True}}]})
    assert spec.model_dump() == as_mapping.model_dump()
    with pytest.raises(moespec.SpecError, match="top_k is given twice"):
        moespec.load_spec({"backbone": TINY_VIT, "moe": [{**group, "router": TopKRouterSpec(top_k=2)}]})
    with pytest.raises(moespec.SpecError, match="capacity_factor applies to topk routers only, not image"):
        moespec.load_spec({"backbone": TINY_VIT, "moe": [{**group, "router": ImageRouterSpec(kind="image")}]})

"""The CLI's backbone-sketch cache (`moespec.planning.cache`): a plan from a cached sketch is the plan from the
model, for every shipped spec and every mistake of the bad-spec corpus; a broken entry is rebuilt, a cache
that cannot be written is skipped, and `validate` of a backbone seen before imports neither torch nor timm."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moespec.errors import MoespecError
from moespec.planning import cache_folder, plan
from moespec.planning.cache import entry_file
from moespec.spec import load_spec

from ..conftest import SPECS_DIR, TINY_VIT, make_spec, write

CORPUS = Path(__file__).parent.parent / "data" / "bad_specs"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache folder of this test's own."""
    monkeypatch.setenv("MOESPEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def outcome(spec, **kwargs) -> object:
    """The plan of `spec`, or the text of the error it raises."""
    try:
        return plan(spec, **kwargs)
    except MoespecError as error:
        return f"{type(error).__name__}: {error}"


def entries(cache: Path) -> list[Path]:
    return sorted((cache / "backbones").glob("*.json")) if (cache / "backbones").exists() else []


@pytest.mark.slow  # every real-size shipped spec: CI runs it
def test_every_shipped_spec_plans_the_same_from_its_cached_sketch(cache):
    specs = [load_spec(path) for path in sorted(SPECS_DIR.glob("*.yaml"))]
    expected = [outcome(spec) for spec in specs]
    assert [outcome(spec, cached=True) for spec in specs] == expected  # cold: built, then written
    assert len(entries(cache)) == len({(s.backbone.model, json.dumps(s.backbone.kwargs, sort_keys=True))
                                       for s in specs})
    assert [outcome(spec, cached=True) for spec in specs] == expected  # warm: read


def test_every_mistake_of_the_corpus_reads_the_same_from_the_cache(cache):
    for path in sorted(CORPUS.glob("*.yaml")):
        try:
            spec = load_spec(path)
        except MoespecError:
            continue  # refused before any backbone is read
        expected = outcome(spec)
        assert outcome(spec, cached=True) == expected, path.name
        assert outcome(spec, cached=True) == expected, path.name


def test_an_input_size_the_entry_has_not_seen_is_tried_on_the_model_and_added(cache, tmp_path):
    taken = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4}])
    refused = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4}], input_size=[3, 60, 60])
    plan(taken, cached=True)
    (file,) = entries(cache)
    assert [size for size, _ in json.loads(file.read_text())["inputs"]] == [[3, 64, 64]]
    with pytest.raises(MoespecError, match=r"cannot take input size \[3, 60, 60\]") as cold:
        plan(refused, cached=True)
    assert len(json.loads(file.read_text())["inputs"]) == 2
    with pytest.raises(MoespecError) as warm:
        plan(refused, cached=True)
    assert str(warm.value) == str(cold.value)


@pytest.mark.parametrize("damage", [
    b"", b"{", b"[]", b'{"format": 1}', b"\xff\xfe", b" " * 5_000_000,
    "change a width to a string", "drop a block", "an input size of two numbers",
])
def test_a_broken_entry_is_rebuilt_from_the_model(cache, damage):
    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4}])
    expected = plan(spec)
    plan(spec, cached=True)
    (file,) = entries(cache)
    good = file.read_text()
    entry = json.loads(good)
    if damage == "change a width to a string":
        next(iter(entry["sketch"]["ffns"].values()))["hidden"] = "1536"
    elif damage == "drop a block":
        del entry["sketch"]["layout"]["blocks"][0]["path"]
    elif damage == "an input size of two numbers":
        entry["inputs"][0][0] = [64, 64]
    file.write_bytes(damage if isinstance(damage, bytes) else json.dumps(entry).encode())
    assert plan(spec, cached=True) == expected
    assert file.read_text() == good  # rewritten whole
    assert plan(spec, cached=True) == expected


def test_each_backbone_has_its_own_entry(cache):
    deeper = {**TINY_VIT, "kwargs": {**TINY_VIT["kwargs"], "depth": 4}}
    two = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4}])
    four = make_spec(deeper, [{"where": {"every": 1}, "experts": 4}])
    assert len(plan(two, cached=True).layers) == 2
    assert len(plan(four, cached=True).layers) == 4
    assert len(plan(two, cached=True).layers) == 2
    assert entry_file(two) != entry_file(four) and len(entries(cache)) == 2


def test_an_empty_cache_dir_turns_the_cache_off(monkeypatch, tmp_path):
    monkeypatch.setenv("MOESPEC_CACHE_DIR", "")
    assert cache_folder() is None
    plan(make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4}]), cached=True)


def test_a_cache_that_cannot_be_written_is_skipped(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MOESPEC_CACHE_DIR", str(blocker / "cache"))
    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4}])
    assert plan(spec, cached=True) == plan(spec)
    assert blocker.read_text() == "not a folder"


def test_the_library_plan_does_not_use_the_cache(cache):
    plan(make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4}]))
    assert entries(cache) == []


@pytest.mark.slow  # the CLI in a subprocess: CI runs it
def test_validate_of_a_backbone_seen_before_imports_neither_torch_nor_timm(cache, tmp_path):
    spec = write(tmp_path, "backbone: {model: vit_small_patch16_224, kwargs: {depth: 2}}\n"
                           "moe: [{where: {every: 1}, experts: 4}]\n")
    code = (f"import sys\nfrom moespec.cli import app\ntry:\n    app(['validate', {str(spec)!r}])\n"
            f"except SystemExit as exit:\n    assert not exit.code, exit.code\n"
            f"print(sorted(m for m in ('torch', 'timm') if m in sys.modules))")
    env = {**__import__("os").environ, "MOESPEC_CACHE_DIR": str(cache)}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
            for _ in range(2)]
    assert [run.returncode for run in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    assert runs[0].stdout.splitlines()[-1] == "['timm', 'torch']"  # cold: the backbone is built once
    assert runs[1].stdout.splitlines()[-1] == "[]"
    assert runs[0].stdout.splitlines()[0] == runs[1].stdout.splitlines()[0]  # the same "ok: ..." line


@pytest.mark.parametrize("planted", ["fifo", pytest.param("folder", marks=pytest.mark.slow)])  # 6 s each
def test_an_entry_that_is_not_a_regular_file_is_skipped(cache, tmp_path, planted):
    """A fifo at the entry's path made `validate` wait for a writer until it was killed."""
    import os

    path = write(tmp_path, "backbone: {model: vit_small_patch16_224, kwargs: {depth: 2, img_size: 64}}\n"
                           "moe: [{where: {every: 1}, experts: 4}]\n")
    file = entry_file(load_spec(path))
    file.parent.mkdir(parents=True)
    os.mkfifo(file) if planted == "fifo" else file.mkdir()
    env = {**os.environ, "MOESPEC_CACHE_DIR": str(cache)}
    try:
        done = subprocess.run([sys.executable, "-m", "moespec.cli", "validate", str(path)], capture_output=True,
                              text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("validate waited on the planted entry")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout == f"ok: {path} (vit_small_patch16_224, 2 MoE layers)\n"


def _forged(cache: Path, spec, hidden: int) -> Path:
    """The spec's entry, well-formed, with every FFN's hidden width set to `hidden`."""
    plan(spec, cached=True)
    (file,) = entries(cache)
    entry = json.loads(file.read_text())
    for ffn in entry["sketch"]["ffns"].values():
        ffn["hidden"] = hidden
    file.write_text(json.dumps(entry))
    return file


@pytest.mark.parametrize("how", ["another user's", "writable by others", "filed under another key"])
def test_an_entry_that_is_not_ours_changes_nothing(cache, how, monkeypatch):
    """A well-formed entry in a shared MOESPEC_CACHE_DIR made `plan` report hidden width 1024 for 256."""
    import os

    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4}])
    expected = plan(spec)
    file = _forged(cache, spec, 1024)
    if how == "another user's":
        if os.geteuid() == 0:
            os.chown(file, 4321, 4321)
        else:
            monkeypatch.setattr("moespec.files._this_user", lambda: os.geteuid() + 1)
    elif how == "writable by others":
        file.chmod(0o666)
    else:
        entry = json.loads(file.read_text())
        entry["key"]["model"] = "another_model"
        file.write_text(json.dumps(entry))
    assert plan(spec, cached=True) == expected
    monkeypatch.undo()
    if how != "another user's":  # rewritten ours
        assert plan(spec, cached=True) == expected and not file.stat().st_mode & 0o077


def test_an_entry_planted_or_edited_by_this_user_changes_nothing(cache):
    """Issue 64, point 4: a well-formed entry of this user's, private, filed under its key, but written by hand
    (hidden width 1024 for 1536) made `plan` report it. It matches no signature of the cache's own key, so the
    backbone is read from the model again and the entry written anew."""
    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4}])
    expected = plan(spec)
    file = _forged(cache, spec, 1024)
    assert not file.stat().st_mode & 0o077  # ours, as a planted entry of this user's is
    assert plan(spec, cached=True) == expected
    hidden = expected.layers[0].expert_hidden  # the model's FFN width, 4 x 384 = 1536 for ViT-S
    assert hidden == 1536
    assert all(ffn["hidden"] == hidden for ffn in json.loads(file.read_text())["sketch"]["ffns"].values())


def test_an_entry_the_cache_wrote_is_used_without_building_the_model(cache, monkeypatch):
    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4}])
    expected = plan(spec, cached=True)
    built = []
    monkeypatch.setattr("moespec.backbones.create_backbone", lambda *a, **k: built.append(1) or 1 / 0)
    assert plan(spec, cached=True) == expected and built == []
    (key,) = cache.glob(".key-*")
    key.chmod(0o644)  # a signing key that others may read signs nothing: the entry is not trusted
    with pytest.raises(ZeroDivisionError):
        plan(spec, cached=True)
    assert built == [1]


def test_relative_cache_folders_make_nothing_in_the_working_folder(monkeypatch, tmp_path):
    """A relative XDG_CACHE_HOME, or a `~` the shell left unexpanded in MOESPEC_CACHE_DIR, made folders in the
    working folder."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.delenv("MOESPEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert cache_folder() == home / ".cache" / "moespec"
    monkeypatch.setenv("MOESPEC_CACHE_DIR", "~/moespec-cache")
    assert cache_folder() == home / "moespec-cache"
    plan(make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4}]), cached=True)
    assert (home / "moespec-cache" / "backbones").is_dir()
    monkeypatch.setenv("MOESPEC_CACHE_DIR", "cache")
    assert cache_folder() is None
    assert list((tmp_path / "work").iterdir()) == []

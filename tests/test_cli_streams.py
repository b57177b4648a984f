"""The command line with its streams taken away (issue 47): stderr closed or its reader gone, stdout's reader
gone, and a locale that cannot show the table's rules. Each run succeeds, or exits 2 with one line; none is an
internal error. In subprocesses (the streams are the process's own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import write

ROOT = Path(__file__).parent.parent
SPEC = ("backbone: {model: vit_small_patch16_224, kwargs: {depth: 2, img_size: 32, embed_dim: 32, num_heads: 2}}\n"
        "input_size: [3, 32, 32]\nmoe: [{where: {every: 1}, experts: 4}]\n")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "MOESPEC_CACHE_DIR": str(tmp_path / "cache"), **extra}


def _moespec(*args: str, tmp_path: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moespec.cli", *args], cwd=tmp_path, env=popen.pop("env", None)
                            or _env(tmp_path), **popen)


def test_schema_with_stdouts_reader_gone_exits_quietly(tmp_path):
    """Broken pipe on stdout (`| head`): an internal error. Nothing is said, and the exit is clean."""
    run = _moespec("schema", tmp_path=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    run.stdout.close()  # before it writes: every write finds no reader
    assert run.wait(timeout=120) == 0
    assert run.stderr.read() == b""


@pytest.mark.slow  # builds two models in a subprocess: CI runs it
def test_stats_with_stderr_closed_or_its_reader_gone_still_prints_its_table(tmp_path):
    specs = [str(write(tmp_path, SPEC, name)) for name in ("a.yaml", "b.yaml")]
    closed = _moespec("stats", *specs, tmp_path=tmp_path, stdout=subprocess.PIPE, preexec_fn=lambda: os.close(2))
    gone = _moespec("stats", *specs, tmp_path=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    gone.stderr.close()
    for run in (closed, gone):
        out, _ = run.communicate(timeout=300)
        assert run.returncode == 0
        assert out.count(b"\n") > 4 and b" a " in out and b" b " in out


@pytest.mark.slow  # builds a model in a subprocess: CI runs it
def test_stats_under_a_latin_1_locale_prints_its_table(tmp_path):
    spec = str(write(tmp_path, SPEC, "a.yaml"))
    done = subprocess.run([sys.executable, "-m", "moespec.cli", "stats", spec], cwd=tmp_path, capture_output=True,
                          timeout=300, env=_env(tmp_path, LC_ALL="C", LANG="C", PYTHONIOENCODING="latin-1"))
    assert done.returncode == 0, done.stderr.decode("latin-1")
    assert b" a " in done.stdout and done.stderr == b""

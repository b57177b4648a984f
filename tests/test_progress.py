"""Progress: a bar drawn on stderr when it is a terminal, one plain line per item when it is piped, nothing
under `--quiet`.

Each command is run as a subprocess, with stderr either piped or attached to a pseudo-terminal; all of them
start at once (each mostly waits on its torch/timm import).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import TINY_SPEC_YAML

pytestmark = pytest.mark.slow  # each test runs moespec in subprocesses (CI runs them; README)

pty = pytest.importorskip("pty")

ENV = {**os.environ, "TERM": "xterm", "COLUMNS": "120", "OMP_NUM_THREADS": "1"}


def run_piped(args: list[str], cwd) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, "-m", "moespec.cli", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


def run_on_terminal(args: list[str], cwd) -> tuple[int, str, str]:
    """Run with stderr on a pseudo-terminal (as in an interactive shell) and stdout piped."""
    leader, follower = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "moespec.cli", *args], cwd=cwd, env=ENV,
                               stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    terminal = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        terminal += chunk
    stdout = process.communicate(timeout=300)[0]
    os.close(leader)
    return process.returncode, stdout.decode(), terminal.decode(errors="replace")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    (root / "a.yaml").write_text(TINY_SPEC_YAML)
    (root / "specs").mkdir()
    for name in "a.yaml", "b.yaml":
        (root / "specs" / name).write_text(TINY_SPEC_YAML)
    jobs = {
        "piped": (run_piped, ["stats", "a.yaml"]),
        "piped_folder": (run_piped, ["stats", "specs"]),
        "piped_quiet": (run_piped, ["--quiet", "stats", "specs"]),
        "terminal": (run_on_terminal, ["stats", "a.yaml"]),
        "terminal_quiet": (run_on_terminal, ["--quiet", "stats", "a.yaml"]),
    }
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {name: pool.submit(fn, args, root) for name, (fn, args) in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def test_piped_output_has_one_plain_progress_line_per_item(runs):
    """Piped into a file, `stats` over a folder printed nothing for minutes (the bar draws only on a
    terminal); it prints one plain line per spec on stderr, and its table stays clean."""
    code, stdout, stderr = runs["piped"]
    assert code == 0, stderr
    assert stderr == ""  # one spec: nothing to count off
    assert "\r" not in stdout and "\x1b[" not in stdout and "counting" not in stdout
    assert stdout.count("vit_small_patch16_224") == 1
    code, stdout, stderr = runs["piped_folder"]
    assert code == 0, stderr
    assert stderr.splitlines() == ["moespec: counting: 1/2 a.yaml", "moespec: counting: 2/2 b.yaml"]
    assert "\x1b[" not in stdout and stdout.count("vit_small_patch16_224") == 2
    code, stdout, stderr = runs["piped_quiet"]
    assert code == 0 and stderr == ""


def test_a_terminal_shows_the_progress_bar(runs):
    code, stdout, terminal = runs["terminal"]
    assert code == 0, terminal
    assert "counting" in terminal and "\x1b[" in terminal
    assert "counting" not in stdout and "\x1b[" not in stdout  # the table stays clean


def test_quiet_hides_the_progress_bar_on_a_terminal(runs):
    code, stdout, terminal = runs["terminal_quiet"]
    assert code == 0, terminal
    assert terminal == ""
    assert stdout.count("vit_small_patch16_224") == 1

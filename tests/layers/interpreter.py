"""Triton kernels run without a GPU only in Triton's interpreter, which reads TRITON_INTERPRET when the kernels are
defined, that is when moespec is imported. So a test file of kernels runs itself again in a subprocess with
TRITON_INTERPRET=1 (`run_interpreted`), where its tests marked `interpreted` run; in the parent they skip."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in its file's interpreter subprocess")
parent = pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="needs triton; the parent of the interpreted run")


def run_interpreted(test_file: str, timeout: int, select: str | None = None) -> None:
    """Run `test_file`'s tests (those matching `select`, pytest's -k) under TRITON_INTERPRET=1 in a subprocess;
    fail with its output unless they passed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
    run = subprocess.run(command + (["-k", select] if select else []), env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-3000:]

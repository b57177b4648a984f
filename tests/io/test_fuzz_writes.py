"""tools/fuzz_writes.py, a few rounds of each write path (issue 64, point 2: the Hub folder and the compress
commands' writes among them): killed writers, two writers at once and planted names leave every output as one
write's whole output. The tool exits 1 on any failure it finds; its own long runs are in the closing notes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "fuzz_writes.py"


@pytest.mark.slow
@pytest.mark.parametrize(("paths", "fixes"), [("hub", 0), ("compress", 0), ("checkpoint,state", 0),
                                              ("report,plot", 6)])
def test_killed_and_concurrent_writes_leave_one_whole_output(paths, fixes):
    """Every write path, and `validate --fix` while an editor saves the spec (`fixes` rounds)."""
    done = subprocess.run([sys.executable, str(TOOL), "--rounds", "8", "--planted", "4", "--fixes", str(fixes),
                           "--seed", "1", "--paths", paths], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^\d+ rounds in \d+ s, 0 with a failure$", done.stdout, re.M), done.stdout[-3000:]

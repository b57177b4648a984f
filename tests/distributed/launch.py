"""Run a script on W gloo ranks under torchrun, in a subprocess with a timeout, so that a hang fails the test
instead of stalling CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def torchrun(world: int, script: Path | str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node world script args` from the repository root; raises AssertionError with the
    output on a non-zero exit or past `timeout` seconds."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
               str(script), *map(str, args)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EP_DUMP_AFTER": str(int(timeout) - 20)}
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        raise AssertionError(f"torchrun on {world} ranks hung past {timeout} s:\n{expired.stderr}") from None
    assert done.returncode == 0, f"torchrun on {world} ranks failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return done

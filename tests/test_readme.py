"""The README as a new user runs it: every ```bash and ```python block, in order, in one fresh copy of the
repository (a later block reads what an earlier one wrote, and none may collide with another: two blocks
that both wrote `sweep.png` made the second one exit 2).

A block that cannot run here says why in the comment line above it, `<!-- readme-test: skip: REASON -->`
(an install, 8 GPUs, a dataset); `<!-- readme-test: LAUNCHER -->` runs a Python block with that launcher
(`torchrun ...`). YAML blocks are spec excerpts, not commands."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<marker>[^\n]*?) -->\n)?^```(?P<lang>\w*)\n(?P<code>.*?)^```$",
                   re.S | re.M)
RUN = ("bash", "python")


def readme_blocks() -> list[tuple[str, str, str]]:
    """(marker, language, code) of every fenced block of README.md, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [(m["marker"] or "", m["lang"], m["code"]) for m in BLOCK.finditer(text)]


def test_every_command_block_is_run_or_says_why_not():
    blocks = [b for b in readme_blocks() if b[1] in RUN]
    assert len(blocks) >= 10
    for marker, language, code in blocks:
        assert marker == "" or marker.startswith("skip: ") and len(marker) > 12 or (
            language == "python" and marker.startswith("torchrun ")), (marker, code[:80])
    skipped = [b for b in blocks if b[0].startswith("skip: ")]
    assert len(skipped) <= 5, [b[0] for b in skipped]  # the installs, 8 GPUs, timm's repository, module source


@pytest.mark.slow  # every README command, real-size models included: minutes
def test_the_readme_runs_in_order_in_one_fresh_folder(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the copy is of the tracked files)")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    folder = tmp_path / "clone"
    for name in filter(None, tracked.stdout.split("\0")):
        if (ROOT / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, folder / name)
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PYTHONPATH": str(folder),
           "OMP_NUM_THREADS": "2"}
    for index, (marker, language, code) in enumerate(readme_blocks()):
        if language not in RUN or marker.startswith("skip: "):
            continue
        if language == "bash":
            argv = ["bash", "-euo", "pipefail", "-c", code]
        else:
            script = folder / f"readme_block_{index}.py"
            script.write_text(code, encoding="utf-8")
            argv = [*shlex.split(marker), script.name] if marker else [sys.executable, script.name]
        done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, f"README block {index} ({language}):\n{code}\n{done.stderr[-3000:]}"

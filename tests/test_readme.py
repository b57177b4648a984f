"""The README as a new user runs it, then the docs pages it links: every ```bash and ```python block, in order
(the README's, then each page of `PAGES` in turn), in one fresh copy of the repository (a later block reads
what an earlier one wrote, and none may collide with another: two blocks that both wrote `sweep.png` made the
second one exit 2). Every block writes under `scratch/` (.gitignore'd): the copy's other files stay as
they were.

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


PAGES = ("README.md", "docs/tour.md", "docs/usage.md", "docs/training.md", "docs/spec.md", "docs/layer.md",
         "docs/upcycling.md", "docs/counting.md", "docs/checkpoints.md", "docs/import.md", "docs/extending.md",
         "docs/development.md", "docs/compress.md", "docs/detection.md")
"""The pages whose blocks run, in the order they run: the README's workflow first, then the details."""


def readme_blocks() -> list[tuple[str, str, str]]:
    """(marker, language, code) of every fenced block of the README and the docs pages, in `PAGES` order."""
    blocks = []
    for page in PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        blocks += [(m["marker"] or "", m["lang"], m["code"]) for m in BLOCK.finditer(text)]
    return blocks


def test_every_page_with_command_blocks_runs():
    """A docs page with a ```bash or ```python block is in `PAGES`, so that its commands are run."""
    with_commands = {str(page.relative_to(ROOT)) for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
                     if any(m["lang"] in RUN for m in BLOCK.finditer(page.read_text(encoding="utf-8")))}
    assert with_commands <= set(PAGES), sorted(with_commands - set(PAGES))


def test_every_command_block_is_run_or_says_why_not():
    blocks = [b for b in readme_blocks() if b[1] in RUN]
    assert len(blocks) >= 10
    for marker, language, code in blocks:
        assert marker == "" or marker.startswith("skip: ") and len(marker) > 12 or (
            language == "python" and marker.startswith("torchrun ")), (marker, code[:80])
    skipped = [b for b in blocks if b[0].startswith("skip: ")]
    assert len(skipped) <= 7, [b[0] for b in skipped]  # the installs, 8 GPUs, several nodes, timm's repository,
    # module source, gsutil


@pytest.mark.slow  # every README command, real-size models included: minutes
def test_the_readme_runs_in_order_in_one_fresh_folder(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the copy is of the tracked files)")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    folder = tmp_path / "clone"
    tracked_names = set(filter(None, tracked.stdout.split("\0")))
    for name in tracked_names:
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
            script = folder / "scratch" / f"readme_block_{index}.py"
            script.parent.mkdir(exist_ok=True)
            script.write_text(code, encoding="utf-8")
            name = str(script.relative_to(folder))
            argv = [*shlex.split(marker), name] if marker else [sys.executable, name]
        done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, f"README block {index} ({language}):\n{code}\n{done.stderr[-3000:]}"
    # every output under scratch/ (the README's scratch folder, in .gitignore); Python's own caches aside
    made = [str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()
            and str(path.relative_to(folder)) not in tracked_names and path.relative_to(folder).parts[0] != "scratch"
            and "__pycache__" not in path.parts]
    assert made == [], made[:20]

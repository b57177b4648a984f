"""save_state killed at every point, then the next load_state and save_state; run by test_training_state.py.

    python tests/distributed/state_worker.py MODE OUT_DIR [POINT ...]

Each save and each check runs in a child forked from this process (which builds the model once, on one
thread, and never joins a process group itself); each child joins its own gloo group of world size 1, so
that save_state and load_state take their torch.distributed paths. A save at step s saves weights = base + s,
so that a load shows which save it reads.

Modes:
    points   the number of points a save passes: lines of moespec/distributed/state.py and of shutil (inside
             rmtree), and renames (os.replace, os.rename)
    kill     for each POINT (`line:N`, or `rename:N` for just after the N-th rename): save step 1, then a
             save of step 2 killed (os._exit) at that point, then, on two copies of the folder, load_state
             then save_state of step 3, and save_state of step 3 then load_state
    sigkill  POINT rounds: a child saves steps 2, 3, ... over and over and is SIGKILLed after a random time;
             then load_state must read the last complete save or the one being written, and save_state work
Folders planted next to the state (another process's, or holding a foreign file) must survive every round.
Writes OUT_DIR/MODE.json: {"points": N} or a list of {"point", "problems"} (an empty list: all held).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

torch.set_num_threads(1)  # before any op: a forked child must not inherit an OpenMP pool

import torch.distributed as dist  # noqa: E402

import moespec  # noqa: E402
import moespec.distributed as md  # noqa: E402
from tests.distributed.ep_cases import VIT  # noqa: E402

SPEC = moespec.load_spec({"name": "state-kill", "backbone": VIT, "input_size": [3, 32, 32],
                          "moe": [{"where": {"every": 1}, "experts": 2, "top_k": 1}]})
KILLED = 77  # a child's exit status when it was killed at its point
CHILD_TIMEOUT = 60


def _model():
    model = moespec.create_model(SPEC, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()  # moments to save
    return model, optimizer


MODEL, OPTIMIZER = _model()
BASE = {name: p.detach().clone() for name, p in MODEL.named_parameters()}


def _set_step(step: int) -> None:
    with torch.no_grad():
        for name, p in MODEL.named_parameters():
            p.copy_(BASE[name] + step)


def _in_child(work, timeout: float = CHILD_TIMEOUT) -> int:
    """Run work() in a forked child in its own gloo group of 1; its exit status (KILLED when killed at its
    point, 1 on an exception, -9 when it ran past `timeout`)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            work()
        except BaseException:  # noqa: BLE001 - the child reports every failure by its status
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -9
        time.sleep(0.01)


class _Points:
    """Counts the points a save passes and exits the process (os._exit) at one of them."""

    FILES = {sys.modules[md.save_state.__module__].__file__, shutil.__file__}

    def __init__(self, kill: str | None):
        self.kind, self.at = (kill.split(":")[0], int(kill.split(":")[1])) if kill else (None, -1)
        self.seen = {"line": 0, "rename": 0}

    def _pass(self, kind: str) -> None:
        self.seen[kind] += 1
        if kind == self.kind and self.seen[kind] == self.at:
            os._exit(KILLED)

    def trace(self, frame, event, arg):
        if frame.f_code.co_filename not in self.FILES:
            return None
        if event == "line":
            self._pass("line")
        return self.trace

    def __enter__(self):
        self.real = {name: getattr(os, name) for name in ("replace", "rename")}
        for name, real in self.real.items():
            setattr(os, name, self._counted(real))
        sys.settrace(self.trace)
        return self

    def _counted(self, rename):
        def counted(*args, **kwargs):
            rename(*args, **kwargs)
            self._pass("rename")
        return counted

    def __exit__(self, *exc):
        sys.settrace(None)
        for name, real in self.real.items():
            setattr(os, name, real)


def _save(root: Path, step: int, kill: str | None = None, counts: Path | None = None) -> None:
    _set_step(step)
    with _Points(kill) as points:
        md.save_state(root / "state", MODEL, OPTIMIZER, extra={"step": step})
    if counts is not None:
        counts.write_text(json.dumps(points.seen))


def _check_load(root: Path, allowed: set[int], report: Path) -> None:
    """load_state reads one of the `allowed` steps, whole: the weights saved with it."""
    extra = md.load_state(root / "state", MODEL, OPTIMIZER)
    step = extra["step"]
    torn = [name for name, p in MODEL.named_parameters() if not torch.equal(p.detach(), BASE[name] + step)]
    report.write_text(json.dumps({"step": step, "allowed": step in allowed, "torn": torn[:3]}))


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _plant(root: Path) -> list[str]:
    """Folders next to the state that no save may remove: a dead process's with a foreign file, and a
    live process's (this one's) holding state files."""
    dead = _dead_pid()
    live = os.getpid()
    planted = {root / f".state.old-{dead}": "notes.txt", root / f".state.{dead}.abcdefgh.tmp": "notes.txt",
               root / f".state.old-{live}": "extra.json", root / f".state.{live}.zzzzzzzz.tmp": ".metadata"}
    for folder, file in planted.items():
        folder.mkdir()
        (folder / file).write_text("not yours")
    return sorted(p.name for p in planted)


def _after_kill(root: Path, allowed: set[int], order: str, planted: list[str]) -> list[str]:
    """The next ordinary commands on a folder a save was killed in: load then save (or save then load)."""
    problems = []
    report = root / "report.json"
    steps = [("load", allowed), ("save", None), ("load", {3})] if order == "load-first" else \
        [("save", None), ("load", {3})]
    for what, want in steps:
        if what == "save":
            status = _in_child(partial(_save, root, 3))
            if status != 0:
                problems.append(f"{order}: the next save_state failed (status {status})")
                return problems
        else:
            status = _in_child(partial(_check_load, root, want, report))
            if status != 0:
                problems.append(f"{order}: load_state failed (status {status}) with {_listing(root)}")
                return problems
            result = json.loads(report.read_text())
            if not result["allowed"] or result["torn"]:
                problems.append(f"{order}: load_state read {result} (expected a step in {sorted(want)})")
    left = sorted(p.name for p in root.iterdir() if p.name not in ("state", "report.json"))
    if left != planted:
        problems.append(f"{order}: left next to the state: {left} (planted: {planted})")
    return problems


def _listing(root: Path) -> dict[str, list[str]]:
    return {p.name: sorted(f.name for f in p.iterdir()) for p in root.iterdir() if p.is_dir()}


def points(out: Path) -> dict:
    root = out / "points"
    root.mkdir()
    assert _in_child(partial(_save, root, 1)) == 0
    _plant(root)  # as `kill` does: the folders a save looks at and leaves
    assert _in_child(partial(_save, root, 2, counts=out / "counts.json")) == 0
    return json.loads((out / "counts.json").read_text())


def kill(out: Path, kills: list[str]) -> list[dict]:
    results = []
    for point in kills:
        root = out / point.replace(":", "-")
        root.mkdir()
        assert _in_child(partial(_save, root, 1)) == 0
        planted = _plant(root)
        status = _in_child(partial(_save, root, 2, kill=point))
        problems = [] if status in (KILLED, 0) else [f"the killed save exited {status}"]
        copy = root.with_name(root.name + "-save-first")
        shutil.copytree(root, copy, symlinks=True)
        problems += (_after_kill(root, {1, 2}, "load-first", planted)
                     + _after_kill(copy, {1, 2}, "save-first", planted))
        results.append({"point": point, "killed": status == KILLED, "problems": problems})
    return results


def _save_forever(root: Path) -> None:
    for step in range(2, 10_000):
        _save(root, step)
        # Atomically: a SIGKILL between write_text's truncate and write would leave an empty record.
        (root / "saved.tmp").write_text(str(step))
        os.replace(root / "saved.tmp", root / "saved.txt")


def sigkill(out: Path, rounds: int) -> list[dict]:
    results = []
    generator = random.Random(37)
    for round_ in range(rounds):
        root = out / f"round-{round_}"
        root.mkdir()
        assert _in_child(partial(_save, root, 1)) == 0
        planted = _plant(root)
        pid = os.fork()
        if pid == 0:
            try:
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                _save_forever(root)
            finally:
                os._exit(1)
        time.sleep(generator.uniform(0.5, 3.0))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        saved = root / "saved.txt"
        last = int(saved.read_text()) if saved.exists() else 1
        saved.unlink(missing_ok=True)
        (root / "saved.tmp").unlink(missing_ok=True)
        problems = _after_kill(root, {last, last + 1}, "load-first", planted)
        results.append({"point": f"round {round_}: SIGKILL after save {last}", "problems": problems})
    return results


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "points":
        result = points(out)
    elif mode == "kill":
        result = kill(out, sys.argv[3:])
    else:
        result = sigkill(out, int(sys.argv[3]))
    (out / f"{mode}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""save_state killed at every point, then the next load_state and save_state; run by test_training_state.py.

    python tests/distributed/state_worker.py MODE OUT_DIR [POINT ...]

Each save and each check runs in children forked from this process (which builds the model once, on one
thread, and never joins a process group itself); the children of one call join their own gloo group, of world
size 1 (so that save_state and load_state take their torch.distributed paths) or of WORLD ranks, whose model
has its experts sharded over them. A save at step s saves weights = base + s, so that a load shows which save
it reads.

Modes:
    points   the number of points a save passes: lines of moespec/distributed/state.py and of shutil (inside
             rmtree), and renames (os.replace, os.rename)
    kill     for each POINT (`line:N`, or `rename:N` for just after the N-th rename; `R:line:N` on rank R of
             WORLD, default rank 0): save step 1, then a save of step 2 killed (os._exit) at that point, the
             other ranks SIGKILLed with it (as torchrun tears a group down), then, on two copies of the folder,
             load_state then save_state of step 3, and save_state of step 3 then load_state
    sigkill  POINT rounds: the ranks save steps 2, 3, ... over and over, and are SIGKILLed after a random time
             (at world size 2: one rank, then the other a moment later, or both at once); then load_state
             must read the last complete save or the one being written, and save_state work
The world size is the environment's STATE_WORLD (default 1); every check runs at that world size.
Folders planted next to the state (another process's, or holding a foreign file) must survive every round.
Writes OUT_DIR/MODE.json: {"points": N} or a list of {"point", "problems"} (an empty list: all held).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
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
WORLD = int(os.environ.get("STATE_WORLD", "1"))
_SHARDED: list = []  # a child's model, optimizer and base weights at WORLD > 1, built once per child


def _state():
    """This child's model, optimizer and base weights: the parent's one-process model, or at WORLD > 1 a model
    whose experts are sharded over the child's group, after the same one step."""
    if WORLD == 1:
        return MODEL, OPTIMIZER, BASE
    if not _SHARDED:
        model = moespec.create_model(SPEC, seed=0)
        md.shard_experts(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))).sum().backward()
        optimizer.step()
        _SHARDED.extend([model, optimizer, {name: p.detach().clone() for name, p in model.named_parameters()}])
    return _SHARDED


def _set_step(step: int) -> None:
    model, _, base = _state()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(base[name] + step)


def _in_child(work, timeout: float = CHILD_TIMEOUT) -> int:
    """Run work() in WORLD forked children, the ranks of their own gloo group; their exit status (KILLED when
    one was killed at its point, 1 on an exception, -9 when they ran past `timeout`). When one rank ends
    killed, the others are SIGKILLed, as torchrun tears a group down."""
    store = Path(tempfile.mkdtemp())
    statuses = _reap(_fork_ranks(work, store / "store"), time.monotonic() + timeout)
    shutil.rmtree(store, ignore_errors=True)
    return next((s for s in statuses if s == KILLED), next((s for s in statuses if s != 0), 0))


def _fork_ranks(work, store: Path) -> list[int]:
    """The pids of WORLD forked children that join one gloo group (through the file `store`) and run work()."""
    pids = []
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                dist.init_process_group("gloo", store=dist.FileStore(str(store), WORLD), rank=rank, world_size=WORLD,
                                        timeout=timedelta(seconds=CHILD_TIMEOUT))
                work()
            except BaseException:  # noqa: BLE001 - the child reports every failure by its status
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        pids.append(pid)
    return pids


def _reap(pids: list[int], deadline: float, tear_down: bool = True) -> list[int]:
    """The exit statuses of `pids`; past `deadline`, or once one ended KILLED (with `tear_down`), the others
    are SIGKILLed (-9)."""
    statuses: dict[int, int] = {}
    while len(statuses) < len(pids):
        for pid in pids:
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = os.waitstatus_to_exitcode(status)
        if len(statuses) < len(pids) and (time.monotonic() > deadline
                                          or tear_down and KILLED in statuses.values()):
            for pid in pids:
                if pid not in statuses:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    statuses[pid] = -9
        time.sleep(0.01)
    return [statuses[pid] for pid in pids]


class _Points:
    """Counts the points a save passes and exits the process (os._exit) at one of them."""

    FILES = {sys.modules[md.save_state.__module__].__file__, shutil.__file__}

    def __init__(self, kill: str | None):
        parts = kill.split(":") if kill else []
        rank = int(parts.pop(0)) if len(parts) == 3 else 0
        mine = parts and rank == (dist.get_rank() if dist.is_initialized() else 0)
        self.kind, self.at = (parts[0], int(parts[1])) if mine else (None, -1)
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
    model, optimizer, _ = _state()
    with _Points(kill) as points:
        md.save_state(root / "state", model, optimizer, extra={"step": step})
    if counts is not None:
        counts.with_name(f"{counts.stem}-rank{dist.get_rank()}.json").write_text(json.dumps(points.seen))


def _check_load(root: Path, allowed: set[int], report: Path) -> None:
    """load_state reads one of the `allowed` steps, whole: the weights saved with it."""
    model, optimizer, base = _state()
    extra = md.load_state(root / "state", model, optimizer)
    step = extra["step"]
    torn = [name for name, p in model.named_parameters() if not torch.equal(p.detach(), base[name] + step)]
    report = report.with_name(f"{report.stem}-rank{dist.get_rank()}.json")
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
            results = [json.loads(report.with_name(f"report-rank{rank}.json").read_text()) for rank in range(WORLD)]
            for rank, result in enumerate(results):
                if not result["allowed"] or result["torn"] or result["step"] != results[0]["step"]:
                    problems.append(f"{order}: load_state on rank {rank} read {result} (expected a step in "
                                    f"{sorted(want)}, the same on every rank)")
    left = sorted(p.name for p in root.iterdir() if not (p.name == "state" or p.name.startswith("report")))
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
    counts = [json.loads((out / f"counts-rank{rank}.json").read_text()) for rank in range(WORLD)]
    return counts[0] if WORLD == 1 else {"ranks": counts, **counts[0]}


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
        _save(root, step)  # returns on every rank once the save is complete (its last barrier)
        if dist.get_rank() == 0:
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
        store = Path(tempfile.mkdtemp())
        pids = _fork_ranks(partial(_save_forever, root), store / "store")
        time.sleep(generator.uniform(0.5, 3.0))
        how = "SIGKILL"
        if WORLD > 1:  # one rank first (the other a moment later, as torchrun tears the group down), or all at once
            first = generator.choice([None, *range(WORLD)])
            if first is not None:
                os.kill(pids[first], signal.SIGKILL)
                time.sleep(generator.uniform(0.0, 0.5))
            how = f"SIGKILL of rank {first} first" if first is not None else "SIGKILL of every rank at once"
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _reap(pids, time.monotonic() + CHILD_TIMEOUT)
        shutil.rmtree(store, ignore_errors=True)
        saved = root / "saved.txt"
        last = int(saved.read_text()) if saved.exists() else 1
        saved.unlink(missing_ok=True)
        (root / "saved.tmp").unlink(missing_ok=True)
        problems = _after_kill(root, {last, last + 1}, "load-first", planted)
        results.append({"point": f"round {round_}: {how} after save {last}", "problems": problems})
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

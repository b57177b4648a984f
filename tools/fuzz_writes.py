"""Fuzz the checkpoint write path (issue 37): random kill points x concurrent writers x shard layouts.

    python tools/fuzz_writes.py [--rounds 60] [--seed 0]

Each round writes a checkpoint (1, 2 or 4 shards), then starts one or two writers that rewrite it at once
(each its own value and layout, with --force), and SIGKILLs each after a random delay. It then checks:

    one write     the path reads as the old checkpoint or one new write whole (never values of two writes)
    folder        the folder reads as the path does
    bystanders    the other files in the folder (another checkpoint's bytes, a user's file, a folder planted
                  under a writer's temp name) are untouched
    next write    an ordinary write (--force: a checkpoint is there) succeeds and leaves only the output's
                  files and the bystanders

and prints how each round ended and every failure. Exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARD_SIZES = {1: 1 << 30, 2: 5 << 20, 4: 3 << 20}  # bytes per shard for 1, 2 or 4 shards of 8 MB of tensors
WRITER = """
import sys, torch
from moespec.io import TensorInfo, write_sharded
path, value, size = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
infos = [TensorInfo(f"t{i}", (256, 1024), torch.float32) for i in range(8)]
print("ready", flush=True)
sys.stdin.readline()
write_sharded(path, infos, lambda info: torch.full(info.shape, value), {}, max_shard_size=size, force=True)
print("done", flush=True)
"""


def _write(path: Path, value: float, files: int) -> None:
    import torch

    from moespec.io import TensorInfo, write_sharded

    infos = [TensorInfo(f"t{i}", (256, 1024), torch.float32) for i in range(8)]
    write_sharded(path, infos, lambda info: torch.full(info.shape, value), {}, max_shard_size=SHARD_SIZES[files],
                  force=True)


def _read(path: Path) -> set[float]:
    """The values a reader gets (`moespec.load`'s reading: `checkpoint_files` checks the shards' write ids)."""
    import torch

    from moespec.io import checkpoint_files, read_safetensors_into

    _, files = checkpoint_files(path)
    targets = {f"t{i}": torch.full((256, 1024), float("nan")) for i in range(8)}
    for file in files:
        read_safetensors_into(file, targets)
    return {value for t in targets.values() for value in t.unique().tolist()}


def _round(folder: Path, rng: random.Random) -> tuple[str, list[str]]:
    """One round; (how it ended, failures)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    path = folder / "out.safetensors"
    _write(folder / "other.safetensors", 9.0, 1)
    (folder / "other.safetensors").rename(folder / "dense.bin")  # a checkpoint of another kind (one per folder)
    (folder / "notes.txt").write_text("a user's")
    planted = folder / f".out.safetensors.{rng.randrange(400000, 500000)}.abcdefgh.tmp"
    planted.mkdir()
    (planted / "notes.txt").write_text("a user's")
    bystanders = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    _write(path, 0.0, rng.choice([1, 2, 4]))
    writers = []
    for value in range(1, rng.choice([1, 2]) + 1):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(float(value)),
                                 str(SHARD_SIZES[rng.choice([1, 2, 4])])], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
        assert proc.stdout.readline().strip() == "ready"
        writers.append(proc)
    for proc in writers:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    deadline = [time.monotonic() + rng.uniform(0.0, 1.0) for _ in writers]
    ended = []
    for proc, at in zip(writers, deadline, strict=True):
        time.sleep(max(0.0, at - time.monotonic()))
        killed = proc.poll() is None
        if killed:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        ended.append("killed" if killed else "finished")
    failures = []
    try:
        got = _read(path)
        if got not in ({0.0}, *({float(v)} for v in range(1, len(writers) + 1))):
            failures.append(f"mixed or wrong values {sorted(got)}")
        if _read(folder) != got:
            failures.append("the folder reads differently from the path")
    except Exception as error:  # noqa: BLE001 - a fuzzer reports what it finds
        failures.append(f"unreadable: {type(error).__name__}: {error}"[:200])
    for name, content in bystanders.items():
        if not (folder / name).is_file() or (folder / name).read_bytes() != content:
            failures.append(f"bystander {name} changed or removed")
    if not (planted / "notes.txt").is_file():
        failures.append("the folder planted under a temp name was removed")
    try:
        _write(path, 5.0, rng.choice([1, 2, 4]))
        if _read(path) != {5.0}:
            failures.append("the next write reads wrong")
        left = sorted(p.name for p in folder.iterdir() if p.name not in bystanders and p != planted)
        if any(name.startswith(".") for name in left):
            failures.append(f"left after the next write: {left}")
    except Exception as error:  # noqa: BLE001
        failures.append(f"the next write failed: {type(error).__name__}: {error}"[:200])
    return f"{len(writers)} writer(s): " + ", ".join(ended), failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    rng = random.Random(args.seed)
    outcomes: dict[str, int] = {}
    failed = 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for number in range(args.rounds):
            ended, failures = _round(Path(tmp) / "round", rng)
            outcomes[ended] = outcomes.get(ended, 0) + 1
            for failure in failures:
                print(f"round {number}: {ended}: FAIL {failure}", flush=True)
            failed += bool(failures)
    print(f"{args.rounds} rounds in {time.perf_counter() - start:.0f} s, {failed} with a failure")
    for ended, count in sorted(outcomes.items()):
        print(f"  {count:4d}  {ended}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

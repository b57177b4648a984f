"""Fuzz moespec's write paths (issues 37, 47): random kill points x concurrent writers x layouts, planted names,
and an editor that saves during `validate --fix`.

    python tools/fuzz_writes.py [--rounds 60] [--planted 24] [--fixes 40] [--seed 0] [--paths checkpoint,...]

The write paths, each through the library function its command calls:

    checkpoint  `compile` / `upcycle` / `moespec.save`: write_sharded, as 1, 2 or 4 shards
    report      `inspect -o`: write_report, a folder (index.html, summary.json, a figure per layer)
    plot        `sweep --plot` and every figure: save_figure, one file (atomic_output)
    state       `moespec.distributed.save_state`: a DCP folder swapped in by renames
    hub         `compile --hub` / `upcycle --hub` / `moespec.save_for_hf`: a Hub folder (config.json, README.md,
                model.safetensors) swapped in whole
    compress    `prune` / `merge` / `densify`: `weights.save` of the new model (its own spec and tensor names)

Each round (`--rounds` per path) writes the output (value 0; for a report, plot or state, in a third of the
rounds nothing is there before), then forks one or two writers that rewrite it at once (each its own value and,
for a checkpoint, its own layout) and SIGKILLs each after a random delay (up to 1.5 times one write's time).
It then checks:

    one write     the path reads as the old output or one new write whole (never files of two writes); a
                  path that was empty may stay empty
    bystanders    the other entries in the folder (another output of the same kind, a user's file, folders
                  planted under a writer's temp and moved-aside names, a live process's temp file) are untouched
    next write    the next ordinary write (with force only where an output is there) succeeds, reads back, and
                  leaves only the outputs and the bystanders: nothing hidden behind

and prints how each round ended (with "killed mid-write" where a kill left hidden files for the next write to
clean up) and every failure, then a table per path.

Planted names (`--planted` rounds per path, issue 47): before a forced write, something that no moespec writer
made is put at one of the names a writer touches (the lock `.{name}.lock`, a temp name and a moved-aside name
with a pid no process can have, or another host's): a symbolic link to a user's file, a fifo, a folder holding
a user's file, a file of other contents. The write must finish (and read back) or be refused with one error
(exit 2), within 60 s; the linked file, the planted name and what it holds must be as they were.

Editors (`--fixes` rounds): `validate --fix` of a spec of the previous release runs in a forked process while
an "editor" saves the file at a random moment, in place or by a rename, adding a line. The editor's line must
be in the file at the end (fixed or not), the file must give the spec it gave, and nothing may be left beside
it. Exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

torch.set_num_threads(1)  # before any op: a forked writer must not inherit an OpenMP pool

import matplotlib  # noqa: E402

matplotlib.use("Agg")

SHARD_SIZES = {1: 1 << 30, 2: 5 << 20, 4: 3 << 20}  # bytes per shard for 1, 2 or 4 shards of 8 MB of tensors
TINY_VIT = {"model": "vit_small_patch16_224",
            "kwargs": {"depth": 2, "img_size": 32, "embed_dim": 32, "num_heads": 2, "num_classes": 10}}
REFUSED = 3  # a writer's exit status when another writer's lock refused it


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _snapshot(entry: Path) -> object:
    """What a bystander holds: a file's bytes, a folder's {name: snapshot}."""
    if entry.is_dir() and not entry.is_symlink():
        return {p.name: _snapshot(p) for p in sorted(entry.iterdir())}
    return entry.read_bytes()


class Checkpoints:
    """write_sharded of 8 tensors of 1 MB, each the write's value, as 1, 2 or 4 shards."""

    name, output = "checkpoint", "out.safetensors"

    def __init__(self, rng: random.Random):
        self.rng = rng

    def write(self, path: Path, value: int, force: bool, files: int | None = None) -> None:
        from moespec.io import TensorInfo, write_sharded

        infos = [TensorInfo(f"t{i}", (256, 1024), torch.float32) for i in range(8)]
        write_sharded(path, infos, lambda info: torch.full(info.shape, float(value)), {},
                      max_shard_size=SHARD_SIZES[files or self.rng.choice([1, 2, 4])], force=force)

    def read(self, path: Path) -> int | None:
        """The value the path reads as (`moespec.load`'s reading: files held open, write ids checked), and the
        folder must read the same."""
        from moespec.io import open_checkpoint

        if not path.exists() and not path.with_name(path.name + ".index.json").exists():
            return None
        values = set()
        for where in (path, path.parent):
            with open_checkpoint(where) as checkpoint:
                targets = {f"t{i}": torch.full((256, 1024), float("nan")) for i in range(8)}
                checkpoint.read_into(targets)
            values.add(frozenset(v for t in targets.values() for v in t.unique().tolist()))
        if len(values) != 1 or len(next(iter(values))) != 1:
            raise AssertionError(f"mixed values, or the folder reads differently: {sorted(map(sorted, values))}")
        return int(next(iter(next(iter(values)))))

    def outputs(self, path: Path) -> list[Path]:
        from moespec.io import checkpoint_files

        index = path.with_name(path.name + ".index.json")
        return [*([index] if index.exists() else []), *checkpoint_files(path)[1]]

    def plant(self, folder: Path) -> None:
        self.write(folder / "other.safetensors", 9, False, files=1)
        (folder / "other.safetensors").rename(folder / "dense.bin")  # one checkpoint per folder: another kind
        planted = folder / f".{self.output}.{_dead_pid()}.abcdefgh.tmp"  # a folder, unmarked, under a temp name
        planted.mkdir()
        (planted / "notes.txt").write_text("a user's")


class Reports:
    """write_report of one routing report (a tiny ViT's, two layers), its source naming the write."""

    name, output = "report", "rep"

    def __init__(self, rng: random.Random):
        from PIL import Image

        import moespec
        from moespec.apps.inspection import find_images, inspect_routing

        self.rng = rng
        with tempfile.TemporaryDirectory() as tmp:
            for label in ("cat", "dog"):
                (Path(tmp) / label).mkdir()
                Image.new("RGB", (32, 32), (40, 80, 120) if label == "cat" else (200, 10, 10)).save(
                    Path(tmp) / label / "0.png")
            spec = moespec.load_spec({"name": "fuzz", "backbone": TINY_VIT, "input_size": [3, 32, 32],
                                      "moe": [{"where": {"every": 1}, "experts": 4, "top_k": 2}]})
            self.report = inspect_routing(moespec.create_model(spec, seed=0), find_images(tmp))
        self.references: dict[int, object] = {}

    def write(self, path: Path, value: int, force: bool) -> None:
        from moespec.apps.inspect_report import write_report

        write_report(dataclasses.replace(self.report, source=f"write-{value}"), path, force=force)

    def reference(self, value: int) -> object:
        if value not in self.references:
            with tempfile.TemporaryDirectory() as tmp:
                self.write(Path(tmp) / "rep", value, False)
                self.references[value] = _snapshot(Path(tmp) / "rep")
        return self.references[value]

    def read(self, path: Path) -> int | None:
        if not path.exists():
            return None
        value = int(json.loads((path / "summary.json").read_text())["source"].removeprefix("write-"))
        if _snapshot(path) != self.reference(value):
            raise AssertionError(f"the report of write {value} is not whole: {sorted(_snapshot(path))}")
        return value

    def plant(self, folder: Path) -> None:
        self.write(folder / "other-rep", 9, False)
        for name in (f".{self.output}.{_dead_pid()}.abcdefgh.tmp", f".{self.output}.old-{_dead_pid()}",
                     f".{self.output}.old-{os.getpid()}"):  # this process's pid: the next write's
            (folder / name).mkdir()  # unmarked: a user's, whatever its name
            (folder / name / "notes.txt").write_text("a user's")


class Plots:
    """save_figure of a load chart whose title names the write (`sweep --plot` writes through it too)."""

    name, output = "plot", "plot.png"

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.references: dict[int, bytes] = {}

    def write(self, path: Path, value: int, force: bool) -> None:
        from moespec.apps.plots import load_figure, save_figure

        save_figure(load_figure(f"write {value}", [0.1 * (i + 1) for i in range(8)]), path, force=force)

    def read(self, path: Path) -> int | None:
        if not path.exists():
            return None
        content = path.read_bytes()
        for value in range(10):
            if value not in self.references:
                with tempfile.TemporaryDirectory() as tmp:
                    self.write(Path(tmp) / "plot.png", value, False)
                    self.references[value] = (Path(tmp) / "plot.png").read_bytes()
            if content == self.references[value]:
                return value
        raise AssertionError(f"the figure is no write's whole figure ({len(content)} bytes)")

    def plant(self, folder: Path) -> None:
        self.write(folder / "other.png", 9, False)
        planted = folder / f".{self.output}.{_dead_pid()}.abcdefgh.tmp"
        planted.mkdir()
        (planted / "notes.txt").write_text("a user's")
        (folder / f".{self.output}.{os.getpid()}.livewrit.tmp").write_text("a live writer's temp file")


class States:
    """save_state in one process of a tiny ViT MoE model + AdamW, its weights base + the write's value."""

    name, output = "state", "state"

    def __init__(self, rng: random.Random):
        import moespec

        self.rng = rng
        spec = moespec.load_spec({"name": "fuzz", "backbone": TINY_VIT, "input_size": [3, 32, 32],
                                  "moe": [{"where": {"every": 1}, "experts": 2, "top_k": 1}]})
        self.model = moespec.create_model(spec, seed=0)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.model(torch.randn(2, 3, 32, 32)).sum().backward()
        self.optimizer.step()
        self.base = {name: p.detach().clone() for name, p in self.model.named_parameters()}

    def write(self, path: Path, value: int, force: bool) -> None:
        import moespec.distributed as md

        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(self.base[name] + value)
        md.save_state(path, self.model, self.optimizer, extra={"step": value})

    def read(self, path: Path) -> int | None:
        import moespec.distributed as md
        from moespec.errors import CheckpointError

        try:
            step = md.load_state(path, self.model, self.optimizer)["step"]
        except CheckpointError:
            if not path.exists():  # load_state finished what a killed save left: nothing was there
                return None
            raise
        torn = [n for n, p in self.model.named_parameters() if not torch.equal(p.detach(), self.base[n] + step)]
        if torn:
            raise AssertionError(f"step {step} read with other weights: {torn[:2]}")
        return step

    def plant(self, folder: Path) -> None:
        self.write(folder / "other-state", 9, False)
        dead, live = _dead_pid(), os.getpid()
        for name, file in {f".state.old-{dead}": "notes.txt", f".state.{dead}.abcdefgh.tmp": "notes.txt",
                           f".state.old-{live}": "extra.json", f".state.{live}.zzzzzzzz.tmp": ".metadata"}.items():
            (folder / name).mkdir()
            (folder / name / file).write_text("not yours")


class HubFolders:
    """save_for_hf of a tiny ViT MoE model (`compile --hub`, `upcycle --hub` write the same folder): its weights
    base + the write's value, its class names and model card naming the write. A folder reads as one write when
    config.json, README.md and model.safetensors all name the same one."""

    name, output = "hub", "hub"

    def __init__(self, rng: random.Random):
        import moespec

        self.rng = rng
        spec = moespec.load_spec({"name": "fuzz", "backbone": TINY_VIT, "input_size": [3, 32, 32],
                                  "moe": [{"where": {"every": 1}, "experts": 4, "top_k": 2}]})
        self.model = moespec.create_model(spec, seed=0)
        self.base = {name: p.detach().clone() for name, p in self.model.state_dict().items()}

    def write(self, path: Path, value: int, force: bool) -> None:
        import moespec

        with torch.no_grad():
            for name, tensor in self.model.state_dict().items():
                tensor.copy_(self.base[name] + value)
        moespec.save_for_hf(self.model, path, force=force, name=f"write-{value}",
                            model_config={"label_names": [f"write-{value}-{i}" for i in range(10)]})

    def read(self, path: Path) -> int | None:
        import moespec

        if not path.exists():
            return None
        config = json.loads((path / "config.json").read_text())
        value = int(config["label_names"][0].split("-")[1])
        if f"write-{value}" not in (path / "README.md").read_text():
            raise AssertionError(f"config.json of write {value}, README.md of another")
        state = moespec.load(path).state_dict()
        torn = [n for n, t in state.items() if not torch.equal(t, self.base[n] + value)]
        if torn:
            raise AssertionError(f"config.json of write {value}, other weights: {torn[:2]}")
        return value

    def plant(self, folder: Path) -> None:
        self.write(folder / "other-hub", 9, False)
        (folder / "notes.txt").write_text("a user's")
        planted = folder / f".{self.output}.{_dead_pid()}.abcdefgh.tmp"
        planted.mkdir()
        (planted / "config.json").write_text("a user's")


class Compressed:
    """The compress commands' write (`prune`, `merge`, `densify`: `weights.save` of the new model, as 1, 2 or 4
    shards): a tiny ViT MoE of 4 experts pruned to 2, merged into 3, or densified, by the write's value (each
    its own spec, tensor names and shapes), its weights base + the value. A checkpoint reads as one write when its spec
    is one operation's and every tensor is that model's + the value."""

    name, output = "compress", "small.safetensors"

    def __init__(self, rng: random.Random):
        import moespec
        from moespec.compress import densify_with_report, merge_with_report, prune_with_report

        self.rng = rng
        spec = moespec.load_spec({"name": "fuzz", "backbone": {**TINY_VIT, "kwargs": {**TINY_VIT["kwargs"],
                                                                                       "embed_dim": 128}},
                                  "input_size": [3, 32, 32],
                                  "moe": [{"where": {"every": 1}, "experts": 4, "top_k": 2}]})
        images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        self.models = [prune_with_report(moespec.create_model(spec, seed=0), images, 2)[0],
                       merge_with_report(moespec.create_model(spec, seed=0), images, 3)[0],
                       densify_with_report(moespec.create_model(spec, seed=0))[0]]
        self.bases = [{n: t.detach().clone() for n, t in m.state_dict().items()} for m in self.models]

    def write(self, path: Path, value: int, force: bool) -> None:
        from moespec.weights import save

        model, base = self.models[value % 3], self.bases[value % 3]
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                tensor.copy_(base[name] + value)
        save(model, path, force=force, max_shard_size=self.rng.choice([1 << 30, 700 << 10, 400 << 10]))

    def read(self, path: Path) -> int | None:
        import moespec

        if not path.exists() and not path.with_name(path.name + ".index.json").exists():
            return None
        model = moespec.load(path)
        state = model.state_dict()
        shapes = {n: t.shape for n, t in state.items()}
        kinds = [i for i, base in enumerate(self.bases) if {n: t.shape for n, t in base.items()} == shapes]
        if len(kinds) != 1:
            raise AssertionError(f"tensors of no one operation's model: {len(state)} tensors")
        base = self.bases[kinds[0]]
        name = next(iter(state))
        value = int(round(float((state[name] - base[name]).flatten()[0])))
        torn = [n for n, t in state.items() if not torch.equal(t, base[n] + value)]
        if torn or value % 3 != kinds[0]:
            raise AssertionError(f"write {value}'s spec with other tensors: {torn[:2]}")
        return value

    def outputs(self, path: Path) -> list[Path]:
        return Checkpoints.outputs(self, path)

    def plant(self, folder: Path) -> None:
        self.write(folder / "other.safetensors", 9, False)
        planted = folder / f".{self.output}.{_dead_pid()}.abcdefgh.tmp"
        planted.mkdir()
        (planted / "notes.txt").write_text("a user's")


for _kind in (Reports, Plots, States, HubFolders):
    _kind.outputs = lambda self, path: [path]
PATHS = {kind.name: kind for kind in (Checkpoints, Reports, Plots, States, HubFolders, Compressed)}


def _fork_writer(kind, path: Path, value: int) -> tuple[int, int]:
    """A forked writer that writes `value` to `path` (with force) once the returned pipe is written to."""
    return _fork(lambda: kind.write(path, value, True), f"writer {value}")


def _fork(action, label: str) -> tuple[int, int]:
    """A forked process that runs `action()` once the returned pipe is written to, and exits 0 when it returns,
    REFUSED when another writer's lock refused it, 2 on any other MoespecError, 1 on anything else."""
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        from moespec.errors import MoespecError

        os.close(go_write)
        os.read(go_read, 1)
        code = 0
        try:
            action()
        except MoespecError as error:
            code = REFUSED if "another moespec process" in str(error) else 2
            print(f"{label}: {error}"[:300], file=sys.stderr)
        except BaseException as error:  # noqa: BLE001 - a fuzzer reports what it finds
            print(f"{label}: {type(error).__name__}: {error}"[:300], file=sys.stderr)
            code = 1
        os._exit(code)
    os.close(go_read)
    return pid, go_write


def _round(kind, folder: Path, rng: random.Random, seconds: float) -> tuple[str, list[str]]:
    """One round; (how it ended, failures)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    path = folder / kind.output
    (folder / "notes.txt").write_text("a user's")
    kind.plant(folder)
    bystanders = {p.name: _snapshot(p) for p in folder.iterdir()}
    old = kind.name == "checkpoint" or rng.random() < 2 / 3
    if old:
        kind.write(path, 0, False)
    values = list(range(1, rng.choice([1, 2]) + 1))
    writers = [_fork_writer(kind, path, value) for value in values]
    for _, go in writers:
        os.write(go, b"g")
        os.close(go)
    start = time.monotonic()
    ended = []
    for pid, _ in writers:
        time.sleep(max(0.0, start + rng.uniform(0.0, 1.5 * seconds) - time.monotonic()))
        done, status = os.waitpid(pid, os.WNOHANG)
        if not done:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            ended.append("killed")
            continue
        code = os.waitstatus_to_exitcode(status)
        ended.append({0: "finished", REFUSED: "refused"}.get(code, f"failed ({code})"))
    failures = [f"a writer {how}" for how in ended if how.startswith("failed")]
    debris = any(p.name.startswith(".") and p.name not in bystanders for p in folder.iterdir())
    allowed = {0} if old else {None}
    allowed |= set(values)
    try:
        got = kind.read(path)
        if got not in allowed:
            failures.append(f"reads as write {got}, not one of {sorted(allowed, key=str)}")
    except Exception as error:  # noqa: BLE001 - a fuzzer reports what it finds
        failures.append(f"unreadable: {type(error).__name__}: {error}"[:300])
    for name, content in bystanders.items():
        if not (folder / name).exists() or _snapshot(folder / name) != content:
            failures.append(f"bystander {name} changed or removed")
    try:
        there = path.exists() or path.with_name(path.name + ".index.json").exists()
        kind.write(path, 5, there)
        if kind.read(path) != 5:
            failures.append("the next write reads wrong")
        outputs = {f.name for f in kind.outputs(path)}
        left = sorted(p.name for p in folder.iterdir() if p.name not in bystanders and p.name not in outputs)
        if left:
            failures.append(f"left after the next write: {left}")
    except Exception as error:  # noqa: BLE001
        failures.append(f"the next write failed: {type(error).__name__}: {error}"[:300])
    left = "; killed mid-write (hidden files left)" if debris else ""
    return (f"{'over an output' if old else 'none before'}, {len(writers)} writer(s): " + ", ".join(ended) + left,
            failures)


PLANTS = ("symlink to a user's file", "fifo", "folder", "file of other contents")


def _planted_names(output: str) -> list[str]:
    """The names beside an output that a writer makes, looks at or removes."""
    from moespec.io.atomic import HOST_TAG

    return [f".{output}.lock", f".{output}.4294967296@{HOST_TAG}.abcdefgh.tmp", f".{output}.0@{HOST_TAG}.abcdefgh.tmp",
            f".{output}.old-4294967296@{HOST_TAG}", f".{output}.old-{_dead_pid()}@0badc0de"]


def _planted_round(kind, folder: Path, rng: random.Random) -> tuple[str, list[str]]:
    """One write with something planted at one of the names a writer touches; (how it ended, failures)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    path = folder / kind.output
    victim = folder / "notes.txt"
    victim.write_text("a user's")
    old = rng.random() < 0.5
    if old:
        kind.write(path, 0, False)
    name, plant = rng.choice(_planted_names(kind.output)), rng.choice(PLANTS)
    planted = folder / name
    if plant == "fifo":
        os.mkfifo(planted)
    elif plant == "folder":
        planted.mkdir()
        (planted / "notes.txt").write_text("a user's")
    elif plant == "symlink to a user's file":
        planted.symlink_to(victim)
    else:
        planted.write_text("a user's")
    before = _snapshot(planted) if plant != "fifo" else None
    pid, go = _fork_writer(kind, path, 7)
    os.write(go, b"g")
    os.close(go)
    deadline, status = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return f"{plant} at {name.split('.', 2)[-1][:24]}: hung", ["the write hung"]
    code = os.waitstatus_to_exitcode(status)
    ended = {0: "written", 2: "refused"}.get(code, f"failed ({code})")
    failures = [f"the writer {ended}"] if ended.startswith("failed") else []
    try:
        got = kind.read(path)
        wanted = {7} if code == 0 else {0 if old else None}
        if got not in wanted:
            failures.append(f"reads as write {got}, not {sorted(wanted, key=str)}")
    except Exception as error:  # noqa: BLE001 - a fuzzer reports what it finds
        failures.append(f"unreadable: {type(error).__name__}: {error}"[:300])
    if victim.read_text() != "a user's":
        failures.append("the user's file changed")
    if not os.path.lexists(planted) or (before is not None and plant != "symlink to a user's file"
                                        and _snapshot(planted) != before) \
            or (plant == "symlink to a user's file" and not planted.is_symlink()):
        failures.append(f"the planted {plant} was changed or removed")
    where = "lock" if name.endswith(".lock") else "temp name" if name.endswith(".tmp") else "moved-aside name"
    return f"{plant} at the {where}: {ended}", failures


FIX_OLD = ("backbone: {model: vit_small_patch16_224, kwargs: {depth: 2, img_size: 32, embed_dim: 32, num_heads: 2}}\n"
           "input_size: [3, 32, 32]\nmoe:\n  - where: {every: 1}  # every block\n    experts: 4\n"
           "    top_k: 2  # two experts\n    capacity_factor: 1.5\n    router:\n      kind: topk\n")


def _fix_round(folder: Path, rng: random.Random, seconds: float) -> tuple[str, list[str]]:
    """`validate --fix` in a forked process while an editor saves the file; (how it ended, failures)."""
    import moespec

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    path = folder / "spec.yaml"
    path.write_text(FIX_OLD)
    spec = moespec.load_spec(path).model_dump()
    from moespec.spec.loading import fix_spec_file

    pid, go = _fork(lambda: fix_spec_file(path), "--fix")
    os.write(go, b"g")
    os.close(go)
    time.sleep(rng.uniform(0.0, 1.5 * seconds))
    edit, how = f"# the user's edit {rng.randrange(10**6)}\n", rng.choice(["in place", "by a rename"])
    text = path.read_text()
    if how == "in place":
        with open(path, "r+") as f:
            f.seek(0, os.SEEK_END)
            f.write(edit)
    else:
        (folder / "spec.yaml.swp").write_text(text + edit)
        os.replace(folder / "spec.yaml.swp", path)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    final = path.read_text()
    failures = [] if code in (0, 2) else [f"--fix failed ({code})"]
    if edit not in final:
        failures.append("the editor's save was lost")
    if moespec.load_spec(path).model_dump() != spec:
        failures.append("the file gives another spec")
    left = sorted(p.name for p in folder.iterdir() if p.name != "spec.yaml")
    if left:
        failures.append(f"left beside it: {left}")
    fixed = "router:\n      kind: topk\n      top_k: 2" in final
    outcome = {0: "fixed", 2: "refused (changed meanwhile)"}.get(code, "failed")
    return f"saved {how}: --fix {outcome}, the file {'fixed' if fixed else 'as the editor left it'}", failures


def _table(summary, name, rounds, failed, outcomes, note="") -> None:
    summary.append((name, rounds, failed, note, outcomes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60, help="rounds per write path")
    parser.add_argument("--planted", type=int, default=24, help="planted-name rounds per write path")
    parser.add_argument("--fixes", type=int, default=40, help="validate --fix rounds with an editor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    total_failed = 0
    start = time.perf_counter()
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.paths.split(","):
            kind = PATHS[name](rng)
            timing = Path(tmp) / "timing"
            timing.mkdir()
            kind.write(timing / kind.output, 0, False)  # the first write pays for lazy imports
            pid, go = _fork_writer(kind, timing / kind.output, 0)
            began = time.perf_counter()
            os.write(go, b"g")
            os.close(go)
            os.waitpid(pid, 0)
            seconds = time.perf_counter() - began  # a forked writer's time: kills land before, during and after
            shutil.rmtree(timing)
            plays = ((name, args.rounds, lambda kind=kind, seconds=seconds: _round(kind, Path(tmp) / "round", rng,
                                                                                   seconds)),
                     (f"{name}, planted names", args.planted,
                      lambda kind=kind: _planted_round(kind, Path(tmp) / "round", rng)))
            for label, rounds, play in plays:
                outcomes: dict[str, int] = {}
                failed = 0
                for number in range(rounds):
                    ended, failures = play()
                    outcomes[ended] = outcomes.get(ended, 0) + 1
                    for failure in failures:
                        print(f"{label} round {number}: {ended}: FAIL {failure}", flush=True)
                    failed += bool(failures)
                total_failed += failed
                note = f" (one write: {seconds:.2f} s)" if label == name else ""
                _table(summary, label, rounds, failed, outcomes, note)
        if args.fixes:
            import moespec
            from moespec.spec.loading import fix_spec_file

            timing = Path(tmp) / "timing"
            timing.mkdir()
            (timing / "spec.yaml").write_text(FIX_OLD)
            moespec.load_spec(timing / "spec.yaml")
            began = time.perf_counter()
            fix_spec_file(timing / "spec.yaml")
            seconds = time.perf_counter() - began
            shutil.rmtree(timing)
            outcomes, failed = {}, 0
            for number in range(args.fixes):
                ended, failures = _fix_round(Path(tmp) / "round", rng, seconds)
                outcomes[ended] = outcomes.get(ended, 0) + 1
                for failure in failures:
                    print(f"fix round {number}: {ended}: FAIL {failure}", flush=True)
                failed += bool(failures)
            total_failed += failed
            _table(summary, "validate --fix with an editor", args.fixes, failed, outcomes,
                   f" (one --fix: {seconds:.2f} s)")
    print(f"{sum(s[1] for s in summary)} rounds in {time.perf_counter() - start:.0f} s, {total_failed} with a failure")
    for name, rounds, failed, note, outcomes in summary:
        print(f"{name}: {rounds} rounds, {failed} with a failure{note}")
        for ended, count in sorted(outcomes.items()):
            print(f"  {count:4d}  {ended}")
    sys.exit(1 if total_failed else 0)


if __name__ == "__main__":
    main()

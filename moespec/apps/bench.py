"""Throughput of MoE models beside their dense backbones, as the seeds' tables print it (images/s in seed 001,
image/sec/core in seed 002, ms/img in seed 004): `moespec bench`.

    load_pair(source)    the MoE model (a spec, randomly initialized; a checkpoint or Hub folder, its weights)
                         and its dense backbone (the spec's timm model, timm's random init)
    bench(sources, ...)  each pair timed interleaved in one process after a warm-up: an eval forward, or with
                         `train` a full training step (forward, cross-entropy + aux loss, backward, AdamW step)
    BenchReport          the machine, and per pair images/s (min / median / max over the rounds) and the ratios

Each round runs one step of each model of a pair on the same random batch, the order swapped every round, so
that a load that comes and goes on a shared machine falls on both. The ratio MoE / dense is taken per round
(the two steps ran seconds apart) and its spread reported over the rounds. The efficiency is the activated
GMACs ratio over the time ratio, (MoE GMACs / dense GMACs) / (MoE time / dense time): 1.0 where the MoE model's
time grows as its counted MACs do; below 1, routing, dispatch and the experts' smaller matmuls cost more than
their MACs. Figures only: a benchmark, not a test.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import aux_loss
from ..backbones import create_backbone
from ..backbones.placement import resolve_device
from ..compiler import create_model, moe_layers, plan_of
from ..counting import stats, tabulate
from ..errors import MoespecError
from ..planning.forward_cost import refuse_costly_forward
from ..spec import Spec, load_spec
from ..spec.loading import SPEC_SUFFIXES
from ..weights import load

DTYPES = {"fp32": None, "bf16": torch.bfloat16}
"""`--dtype`: fp32, or bf16 autocast (weights in fp32, matmuls in bf16, as timm's `--amp --amp-dtype bfloat16`)."""


@dataclass(frozen=True)
class Spread:
    """Min, median and max of a figure over the timed rounds."""

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(min(values), statistics.median(values), max(values))


@dataclass(frozen=True)
class Machine:
    """Where the figures were measured: they hold for this machine at this load only."""

    host: str
    cpu: str
    cores: int
    threads: int  # torch's intra-op threads
    torch: str
    device: str  # "cpu", or the accelerator's name
    load_before: tuple[float, float, float]  # the 1, 5 and 15 minute load averages
    load_after: tuple[float, float, float]


@dataclass(frozen=True)
class PairResult:
    """One MoE model against its dense backbone. Images/s are `batch / step time`; `ratio` is MoE / dense
    images/s, round by round."""

    source: str
    name: str
    backbone: str
    input_size: tuple[int, int, int]
    moe_layers: int
    moe_images_per_s: Spread
    dense_images_per_s: Spread
    ratio: Spread
    moe_gmacs: float  # activated, per image (eval mode for an eval forward)
    dense_gmacs: float
    gmacs_ratio: float
    efficiency: float  # gmacs_ratio / time ratio = gmacs_ratio * ratio.median


@dataclass(frozen=True)
class BenchReport:
    machine: Machine
    mode: str  # "eval" (a forward under inference_mode) or "train" (a full training step)
    device: str
    dtype: str
    batch: int
    rounds: int
    warmup: int
    compiled: bool
    results: list[PairResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_pair(source: str | Path, device: torch.device, seed: int = 0) -> tuple[nn.Module, nn.Module, Spec]:
    """(MoE model, dense backbone, spec) of a spec file (random init, seeded) or of a moespec checkpoint, a
    sharded index or a Hub folder (its own weights). The dense backbone is the spec's timm model with timm's
    init: its weights do not change its time."""
    source = Path(source)
    if not source.exists():
        raise MoespecError(f"{source}: no such spec or checkpoint")
    if source.suffix in SPEC_SUFFIXES:
        spec = load_spec(source)
        model = create_model(spec, device=device, seed=seed)
    else:
        model = load(source, device=device)
        spec = model.moespec_spec
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dense = create_backbone(spec, device=device)
    return model, dense, spec


def machine(device: torch.device, load_before: tuple[float, float, float]) -> Machine:
    """This machine now; `load_before` is the load average read before the first model was built."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return Machine(host=platform.node(), cpu=_cpu_name(), cores=os.cpu_count() or 0, threads=torch.get_num_threads(),
                   torch=torch.__version__, device=name, load_before=load_before, load_after=os.getloadavg())


def _cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what `platform` says."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def bench(sources: Sequence[str | Path], *, device: str = "cpu", batch: int = 32, dtype: str = "fp32",
          train: bool = False, compile: bool = False, rounds: int = 10, warmup: int = 2, seed: int = 0,
          on_round: Callable[[str, int, int], None] | None = None) -> BenchReport:
    """Time each source's MoE model against its dense backbone (see the module docstring). `on_round(item,
    done, total)` is told of every round, warm-up included; `item` names the source at its first round only
    (a log gets one line per source)."""
    if dtype not in DTYPES:
        raise MoespecError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    for value, option in ((batch, "--batch"), (rounds, "--rounds")):
        if value < 1:
            raise MoespecError(f"{option} {value}: expected a whole number of at least 1")
    if warmup < 0:
        raise MoespecError(f"--warmup {warmup}: expected a whole number of at least 0")
    where = resolve_device(device)
    if where.type == "meta":
        raise MoespecError("--device meta: a model on the meta device has no storage to run; use cpu or cuda")
    load_before = os.getloadavg()
    results = []
    total = len(sources) * (warmup + rounds)
    for index, source in enumerate(sources):
        results.append(_bench_pair(source, where, batch, dtype, train, compile, rounds, warmup, seed,
                                   lambda done, i=index, name=Path(source).name: on_round and on_round(
                                       "" if done else name, i * (warmup + rounds) + done, total)))
    if on_round is not None:
        on_round("", total, total)
    return BenchReport(machine=machine(where, load_before), mode="train" if train else "eval", device=str(where),
                       dtype=dtype, batch=batch, rounds=rounds, warmup=warmup, compiled=compile, results=results)


def _bench_pair(source, device: torch.device, batch: int, dtype: str, train: bool, compile: bool, rounds: int,
                warmup: int, seed: int, on_round: Callable[[int], Any]) -> PairResult:
    moe, dense, spec = load_pair(source, device, seed)
    input_size = tuple(plan_of(moe).input_size)
    if device.type == "cpu":
        refuse_costly_forward(spec, input_size, f"a batch of {batch} image(s)", batch=batch,
                              held_bytes=batch * 4 * math.prod(input_size), runner="a batch",
                              hint="use a smaller --batch")
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, *input_size, generator=generator).to(device)
    counted = stats(spec)
    steps = {}
    for name, model in (("moe", moe), ("dense", dense)):
        model.train(train)
        run = torch.compile(model) if compile else model
        steps[name] = _train_step(run, model, images, seed, name == "moe", dtype) if train else \
            _eval_step(run, images, dtype)
    times: dict[str, list[float]] = {"moe": [], "dense": []}
    for done in range(warmup + rounds):
        on_round(done)
        for name in ("moe", "dense") if done % 2 == 0 else ("dense", "moe"):
            seconds = _timed(steps[name], device, source, compile)
            if done >= warmup:
                times[name].append(seconds)
    moe_gmacs = counted.gmacs if train else (counted.eval_gmacs or counted.gmacs)
    ratio = Spread.of([d / m for m, d in zip(times["moe"], times["dense"], strict=True)])
    gmacs_ratio = moe_gmacs / counted.dense_gmacs
    return PairResult(
        source=str(source), name=spec.name or spec.backbone.model, backbone=spec.backbone.model,
        input_size=input_size, moe_layers=len(moe_layers(moe)),
        moe_images_per_s=Spread.of([batch / t for t in times["moe"]]),
        dense_images_per_s=Spread.of([batch / t for t in times["dense"]]),
        ratio=ratio, moe_gmacs=moe_gmacs, dense_gmacs=counted.dense_gmacs, gmacs_ratio=gmacs_ratio,
        efficiency=gmacs_ratio * ratio.median)


def _autocast(dtype: str, device: torch.device):
    if DTYPES[dtype] is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype])


def _eval_step(model: nn.Module, images: torch.Tensor, dtype: str) -> Callable[[], None]:
    def step() -> None:
        with torch.inference_mode(), _autocast(dtype, images.device):
            model(images)

    return step


def _train_step(run: nn.Module, model: nn.Module, images: torch.Tensor, seed: int, moe: bool, dtype: str
                ) -> Callable[[], None]:
    """Forward, cross-entropy on random labels (plus the MoE model's aux loss), backward, AdamW step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    labels: list[torch.Tensor] = []

    def step() -> None:
        with _autocast(dtype, images.device):
            logits = run(images)
        if not labels:  # the head's width, from the first forward
            generator = torch.Generator().manual_seed(seed)
            labels.append(torch.randint(logits.shape[-1], (len(images),), generator=generator).to(images.device))
        loss = F.cross_entropy(logits.float(), labels[0])
        if moe:
            loss = loss + aux_loss(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _timed(step: Callable[[], None], device: torch.device, source, compile: bool) -> float:
    """Seconds of one step, the device synchronized before and after."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    try:
        step()
    except Exception as error:
        if not compile:
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise MoespecError(f"{source}: --compile: torch.compile failed: {first}; run without --compile") from None
    synchronize()
    return time.perf_counter() - start


COLUMNS = ("name", "MoE images/s", "dense images/s", "MoE / dense", "GMACs MoE / dense", "efficiency")
FOOTER = ("images/s: median over the rounds (min - max); MoE / dense: the ratio of images/s, round by round. GMACs: "
          "activated multiply-adds per image (fvcore's convention), the ratio of the MoE model's to its dense "
          "backbone's. efficiency: GMACs ratio / time ratio (1.0: the MoE model's time grows as its MACs).")


def header(report: BenchReport) -> str:
    """The machine and the settings, the lines above the table."""
    m = report.machine
    load = "load average {:.2f} / {:.2f} / {:.2f} before, {:.2f} / {:.2f} / {:.2f} after (1 / 5 / 15 min)".format(
        *m.load_before, *m.load_after)
    step = "a training step (forward, loss + aux, backward, AdamW)" if report.mode == "train" else "an eval forward"
    return (f"machine: {m.host}, {m.cpu}, {m.cores} cores, {m.threads} torch threads, torch {m.torch}, device "
            f"{report.device}{f' ({m.device})' if m.device != report.device else ''}; {load}\n"
            f"timed: {step}, batch {report.batch}, {report.dtype}{', torch.compile' if report.compiled else ''}, "
            f"{report.rounds} rounds after {report.warmup} warm-up, dense and MoE interleaved\n")


def _spread(spread: Spread, digits: int = 1) -> str:
    return f"{spread.median:.{digits}f} ({spread.min:.{digits}f} - {spread.max:.{digits}f})"


CSV_COLUMNS = ("name", "source", *(f"{what}_{s}" for what in ("moe_images_per_s", "dense_images_per_s", "ratio")
                                   for s in ("min", "median", "max")), "moe_gmacs", "dense_gmacs", "gmacs_ratio",
               "efficiency")


def render(report: BenchReport, format: str) -> str:
    """The report as a table, Markdown, CSV (the machine and settings above the table, except CSV) or JSON."""
    if format == "json":
        return json.dumps(report.to_dict(), indent=2) + "\n"
    if format == "csv":
        return tabulate(CSV_COLUMNS, [(r.name, r.source, *(f"{getattr(getattr(r, what), s):.6g}" for what in (
            "moe_images_per_s", "dense_images_per_s", "ratio") for s in ("min", "median", "max")), f"{r.moe_gmacs:.6g}",
            f"{r.dense_gmacs:.6g}", f"{r.gmacs_ratio:.6g}", f"{r.efficiency:.6g}") for r in report.results], "csv")
    rows = [(r.name, _spread(r.moe_images_per_s), _spread(r.dense_images_per_s), _spread(r.ratio, 2),
             f"{r.moe_gmacs:.3f} / {r.dense_gmacs:.3f} = {r.gmacs_ratio:.2f}", f"{r.efficiency:.2f}")
            for r in report.results]
    return header(report) + ("\n" if format == "markdown" else "") + tabulate(COLUMNS, rows, format, FOOTER)

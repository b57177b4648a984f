"""Benchmark expert parallelism: one training step at a fixed global batch on W = 1, 2, 4 ranks.

    python tools/bench_ep.py [--worlds 1 2 4] [--global-batch 8] [--steps 10] [--warmup 3] [--device cpu|cuda]
                             [--json out.json]

For each W, the script runs itself under torchrun (`--standalone --nproc_per_node W`, gloo on CPU, NCCL on
GPUs): every rank builds the same model, keeps E/W experts (`moespec.distributed.shard_experts`), wraps it in
DistributedDataParallel and times full steps (zero_grad, forward, cross-entropy + aux loss, backward, AdamW
step) on global_batch / W images, after warm-up steps. Per W it prints:

- step ms: the median over the timed steps (the slowest rank's median);
- all_to_all ms / share: time inside `torch.distributed.all_to_all_single` per step, and its share of the step
  time (sum over the timed steps). The benchmark process wraps that function with a timer (on GPUs, with a
  synchronize on each side), so it counts every expert exchange of forward and backward: counts, rows and
  their return. The wait for the slowest rank is part of it, as it is part of the step;
- peak memory per rank: CPU `ru_maxrss` (peak resident set), whole and above the rank's resident set before
  the model was built (imports and process group); GPU `torch.cuda.max_memory_allocated`;
- the expert and replicated parameters a rank holds.

At W = 1 it also times, interleaved in one process, the same step of the unsharded model against the model
under `shard_experts` on a world of one (both without DDP): the cost of the expert-parallel wrapper where it
exchanges nothing. On GPUs this is "1 GPU with the wrapper vs 1 GPU without".

The model: a ViT (timm's vit_small_patch16_224 class) of depth 4, width 192, 3 heads, patch 8 at 64 px (65
tokens per image), 8 experts top-2 in every block. torchrun sets OMP_NUM_THREADS=1: W ranks use W cores, so
on a machine with fewer cores than ranks the larger W share cores. Figures only, nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import moespec
import moespec.distributed as md

SPEC = {
    "name": "bench-ep-vit-d4-e8-top2",
    "backbone": {"model": "vit_small_patch16_224",
                 "kwargs": {"depth": 4, "img_size": 64, "patch_size": 8, "embed_dim": 192, "num_heads": 3,
                            "num_classes": 10}},
    "input_size": [3, 64, 64],
    "moe": [{"where": {"every": 1}, "experts": 8, "router": {"top_k": 2}}],
}


class CollectiveTimer:
    """Wraps `torch.distributed.all_to_all_single` (which the expert banks call through the module) and adds
    up the seconds spent in it."""

    def __init__(self, cuda: bool):
        self.seconds, self.calls, self.cuda = 0.0, 0, cuda
        self.original = dist.all_to_all_single

        def timed(*args, **kwargs):
            if self.cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = self.original(*args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return result

        dist.all_to_all_single = timed

    def take(self) -> tuple[float, int]:
        """(seconds, calls) since the last take."""
        taken = self.seconds, self.calls
        self.seconds, self.calls = 0.0, 0
        return taken


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def make_step(model, net, images, labels, device):
    """One training step of `net` (the model, or its DDP wrapper) with its own AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            task = F.cross_entropy(net(images), labels)
        (task + moespec.aux_loss(model).to(task.device)).backward()
        optimizer.step()

    return step


def timed(step, device) -> float:
    """Seconds of one call, the device's queue drained."""
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def wrapper_overhead(spec, images, labels, device, steps: int, warmup: int) -> dict:
    """Median step ms of the unsharded model and of the same model under shard_experts on a world of one
    (no DDP for either), interleaved; ratio sharded / unsharded."""
    plain = moespec.create_model(spec, seed=0).to(device)
    sharded = md.shard_experts(moespec.create_model(spec, seed=0)).to(device)
    steps_of = {"unsharded": make_step(plain, plain, images, labels, device),
                "sharded": make_step(sharded, sharded, images, labels, device)}
    for _ in range(warmup):
        for step in steps_of.values():
            step()
    samples = {name: [] for name in steps_of}
    for _ in range(steps):
        for name, step in steps_of.items():
            samples[name].append(timed(step, device) * 1e3)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {"unsharded_ms": medians["unsharded"], "sharded_ms": medians["sharded"],
            "ratio": medians["sharded"] / medians["unsharded"]}


def worker(args: argparse.Namespace) -> None:
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    baseline = max_rss_mib()
    spec = moespec.load_spec(SPEC)
    per_rank = args.global_batch // world
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(args.global_batch, *SPEC["input_size"], generator=generator)
    labels = torch.randint(10, (args.global_batch,), generator=generator)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    images, labels = images[mine].to(device), labels[mine].to(device)

    model = md.shard_experts(moespec.create_model(spec, seed=0)).to(device)
    net = DistributedDataParallel(model, device_ids=[device] if cuda else None)
    experts, replicated = md.expert_parameters(model)
    step = make_step(model, net, images, labels, device)
    timer = CollectiveTimer(cuda)
    for _ in range(args.warmup):
        step()
    timer.take()
    step_s, a2a_s, calls = [], 0.0, 0
    for _ in range(args.steps):
        step_s.append(timed(step, device))
        seconds, n = timer.take()
        a2a_s, calls = a2a_s + seconds, calls + n
    result = {
        "rank": rank, "step_ms": statistics.median(step_s) * 1e3, "a2a_ms": a2a_s / args.steps * 1e3,
        "a2a_share": a2a_s / sum(step_s), "a2a_calls": calls // args.steps,
        "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else max_rss_mib(),
        "above_baseline_mib": None if cuda else max_rss_mib() - baseline,
        "expert_params_m": sum(p.numel() for p in experts) / 1e6,
        "replicated_params_m": sum(p.numel() for p in replicated) / 1e6,
    }
    if world == 1 and args.overhead:
        dist.all_to_all_single = timer.original
        result["overhead"] = wrapper_overhead(spec, images, labels, device, args.steps, args.warmup)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def launch(world: int, args: argparse.Namespace, out: Path) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
               __file__, "--worker-out", str(out), "--device", args.device, "--global-batch", str(args.global_batch),
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if not args.overhead:
        command.append("--no-overhead")
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"bench_ep: W={world} failed:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def report(results: dict[int, list[dict]], args: argparse.Namespace) -> None:
    memory = "peak GPU MiB" if args.device == "cuda" else "peak RSS MiB (above start)"
    print(f"{SPEC['name']}: global batch {args.global_batch}, median of {args.steps} steps after {args.warmup}, "
          f"{args.device}, {os.cpu_count()} CPU cores")
    header = f"{'W':>2} {'batch/rank':>10} {'step ms':>9} {'img/s':>7} {'a2a ms':>8} {'a2a share':>9} " \
             f"{'a2a calls':>9} {memory:>27} {'experts M/rank':>14} {'replicated M':>12}"
    print(header)
    for world, ranks in results.items():
        step = max(r["step_ms"] for r in ranks)
        a2a = max(r["a2a_ms"] for r in ranks)
        share = max(r["a2a_share"] for r in ranks)
        peak = max(r["peak_mib"] for r in ranks)
        above = max(r["above_baseline_mib"] for r in ranks) if ranks[0]["above_baseline_mib"] is not None else None
        mem = f"{peak:.0f}" + (f" ({above:.0f})" if above is not None else "")
        print(f"{world:>2} {args.global_batch // world:>10} {step:>9.1f} {args.global_batch / step * 1e3:>7.1f} "
              f"{a2a:>8.2f} {share:>9.1%} {ranks[0]['a2a_calls']:>9} {mem:>27} "
              f"{ranks[0]['expert_params_m']:>14.2f} {ranks[0]['replicated_params_m']:>12.2f}")
    overhead = next((r[0]["overhead"] for r in results.values() if "overhead" in r[0]), None)
    if overhead:
        print(f"W=1 wrapper overhead ({args.device}, no DDP, interleaved): unsharded {overhead['unsharded_ms']:.1f} "
              f"ms, shard_experts on a world of 1 {overhead['sharded_ms']:.1f} ms per step: ratio "
              f"{overhead['ratio']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="numbers of ranks to run")
    parser.add_argument("--global-batch", type=int, default=8, help="images per step over all ranks")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: one GPU per rank, NCCL (W at most the GPUs)")
    parser.add_argument("--no-overhead", dest="overhead", action="store_false",
                        help="skip the W=1 sharded-vs-unsharded comparison")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per W before giving up")
    parser.add_argument("--json", type=Path, help="also write the per-rank figures to this file")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # set when this file runs as a torchrun worker
    args = parser.parse_args()
    if args.worker_out:
        worker(args)
        return
    bad = [w for w in args.worlds if args.global_batch % w or 8 % w]
    if bad:
        parser.error(f"--worlds {bad}: W must divide --global-batch {args.global_batch} and the 8 experts")
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for world in args.worlds:
            results[world] = launch(world, args, Path(folder) / f"w{world}.json")
    report(results, args)
    if args.json:
        args.json.write_text(json.dumps({str(w): r for w, r in results.items()}, indent=1))


if __name__ == "__main__":
    main()

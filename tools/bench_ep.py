"""Benchmark the layouts of a 2-D (dp, ep) mesh: one training step at a fixed global batch on W = 1, 2, 4 ranks.

    python tools/bench_ep.py [--worlds 1 2 4] [--spec SPEC] [--global-batch 8] [--steps 10] [--warmup 3]
                             [--device cpu|cuda] [--json out.json]

For each W, the script runs itself under torchrun (`--standalone --nproc_per_node W`, gloo on CPU, NCCL on
GPUs). Every rank builds one model per layout, each laid out by `moespec.distributed.parallelize` on its own
DeviceMesh (dims "dp", "ep"):

    dp x ep  W x 1     ddp   plain DDP: every rank holds every expert, nothing is exchanged (the baseline)
             W/2 x 2   ddp   experts over pairs of ranks, replicated over the W/2 pairs
             1 x W     ddp   experts over every rank (shard_experts + DDP)
             the same three under fsdp (FSDP2 fully_shard per block and root; the experts sharded over dp)

and times full steps (zero_grad, forward, cross-entropy + aux loss, backward, AdamW step) on global_batch / W
images a rank, the layouts interleaved step by step (the order rotating each round, a barrier before each
timed step), after warm-up rounds. A layout whose ep does not divide W or every layer's experts is left out.
Per W and layout it prints:

- step ms: the median over the timed steps (the slowest rank's median), and its ratio to plain DDP's at W;
- all_to_all ms / share / calls: time inside `torch.distributed.all_to_all_single` per step, its share of the
  step time (sum over the timed steps), and its calls per step. The benchmark process wraps that function with
  a timer (on GPUs, with a synchronize on each side), so it counts every expert exchange of forward and
  backward: counts, rows and their return. The wait for the slowest rank is part of it, as it is part of the
  step. FSDP2's all-gathers and reduce-scatters and DDP's all-reduces are not in it;
- the parameters a rank holds (its shards under FSDP2): the experts and the rest.

Per W it prints the peak memory of a rank over all its layouts (CPU `ru_maxrss`; GPU
`torch.cuda.max_memory_allocated`). At W = 1 it also times, interleaved in one process, the same step of the
unsharded model against the model under `shard_experts` on a world of one (both without DDP): the cost of the
expert-parallel wrapper where it exchanges nothing. On GPUs this is "1 GPU with the wrapper vs 1 GPU without".

The model (without --spec): a ViT (timm's vit_small_patch16_224 class) of depth 4, width 192, 3 heads, patch 8
at 64 px (65 tokens per image), 8 experts top-2 in every block. torchrun sets OMP_NUM_THREADS=1: W ranks use W
cores, so on a machine with fewer cores than ranks the larger W share cores. Figures only, nothing is asserted.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

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


def layouts(world: int, experts: list[int]) -> list[tuple[int, int, str]]:
    """(dp, ep, data) of every layout benchmarked at `world` ranks, plain DDP first; those whose ep does not
    divide the world and every layer's experts are left out."""
    found = []
    for data in ("ddp", "fsdp"):
        for ep in (1, 2, world):
            fits = world % ep == 0 and all(count % ep == 0 for count in experts)
            if fits and (world // ep, ep, data) not in found:
                found.append((world // ep, ep, data))
    return found


def spec_experts(spec) -> list[int]:
    """Every MoE layer's experts."""
    return [layer.experts.num_experts for layer in moespec.moe_layers(moespec.create_model(spec)).values()]


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


def held(model) -> tuple[float, float]:
    """(expert, other) parameters this rank holds, in millions (FSDP2's DTensors: this rank's shard)."""
    experts = {id(p) for layer in moespec.moe_layers(model).values() for p in layer.experts.parameters()}
    sizes = {id(p): (p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()}
    mine = sum(n for key, n in sizes.items() if key in experts)
    return mine / 1e6, (sum(sizes.values()) - mine) / 1e6


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
    spec = moespec.load_spec(args.spec or SPEC)
    per_rank = args.global_batch // world
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(args.global_batch, *spec.input_size, generator=generator)
    labels = torch.randint(moespec.create_model(spec).num_classes, (args.global_batch,), generator=generator)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    images, labels = images[mine].to(device), labels[mine].to(device)

    steps, held_m = {}, {}
    for dp, ep, data in layouts(world, spec_experts(spec)):
        model = moespec.create_model(spec, seed=0).to(device).train()
        net = md.parallelize(model, init_device_mesh(device.type, (dp, ep), mesh_dim_names=("dp", "ep")), data=data)
        steps[dp, ep, data] = make_step(model, net, images, labels, device)
        held_m[dp, ep, data] = held(model)
    timer = CollectiveTimer(cuda)
    names = list(steps)
    samples = {name: [] for name in names}
    a2a = {name: [0.0, 0] for name in names}
    for round_ in range(args.warmup + args.steps):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:  # rotating: no layout always first
            dist.barrier()
            timer.take()
            seconds = timed(steps[name], device)
            spent, calls = timer.take()
            if round_ >= args.warmup:
                samples[name].append(seconds)
                a2a[name][0] += spent
                a2a[name][1] += calls
    result = {"rank": rank, "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else max_rss_mib(),
              "layouts": [{"dp": dp, "ep": ep, "data": data,
                           "step_ms": statistics.median(samples[dp, ep, data]) * 1e3,
                           "a2a_ms": a2a[dp, ep, data][0] / args.steps * 1e3,
                           "a2a_share": a2a[dp, ep, data][0] / sum(samples[dp, ep, data]),
                           "a2a_calls": a2a[dp, ep, data][1] // args.steps,
                           "expert_params_m": held_m[dp, ep, data][0], "other_params_m": held_m[dp, ep, data][1]}
                          for dp, ep, data in names]}
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
    command += ["--spec", str(args.spec)] if args.spec else []
    command += [] if args.overhead else ["--no-overhead"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"bench_ep: W={world} failed:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def report(results: dict[int, list[dict]], args: argparse.Namespace, name: str) -> None:
    memory = "peak GPU MiB" if args.device == "cuda" else "peak RSS MiB"
    print(f"{name}: global batch {args.global_batch}, median of {args.steps} steps after {args.warmup}, layouts "
          f"interleaved, {args.device}, {os.cpu_count()} CPU cores")
    print(f"{'W':>2} {'dp x ep':>7} {'data':>4} {'batch/rank':>10} {'step ms':>9} {'vs DDP':>6} {'a2a ms':>8} "
          f"{'a2a share':>9} {'a2a calls':>9} {'experts M/rank':>14} {'rest M/rank':>11}")
    for world, ranks in results.items():
        rows = [[rank["layouts"][i] for rank in ranks] for i in range(len(ranks[0]["layouts"]))]
        baseline = max(r["step_ms"] for r in rows[0])  # plain DDP: layouts() puts it first
        for row in rows:
            first, step = row[0], max(r["step_ms"] for r in row)
            print(f"{world:>2} {first['dp']:>3} x {first['ep']:<1} {first['data']:>4} {args.global_batch // world:>10} "
                  f"{step:>9.1f} {step / baseline:>6.2f} {max(r['a2a_ms'] for r in row):>8.2f} "
                  f"{max(r['a2a_share'] for r in row):>9.1%} {first['a2a_calls']:>9} "
                  f"{first['expert_params_m']:>14.3f} {first['other_params_m']:>11.3f}")
    print(f"{memory} of a rank (all its layouts in one process): "
          + ", ".join(f"W={w} {max(r['peak_mib'] for r in ranks):.0f}" for w, ranks in results.items()))
    overhead = next((r[0]["overhead"] for r in results.values() if "overhead" in r[0]), None)
    if overhead:
        print(f"W=1 wrapper overhead ({args.device}, no DDP, interleaved): unsharded {overhead['unsharded_ms']:.1f} "
              f"ms, shard_experts on a world of 1 {overhead['sharded_ms']:.1f} ms per step: ratio "
              f"{overhead['ratio']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="numbers of ranks to run")
    parser.add_argument("--spec", type=Path, help="a spec YAML to benchmark (default: the ViT of the docstring)")
    parser.add_argument("--global-batch", type=int, default=8, help="images per step over all ranks")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each layout")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each layout first")
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
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: at least 1 timed step")
    spec = moespec.load_spec(args.spec or SPEC)
    experts = spec_experts(spec)
    bad = [w for w in args.worlds if w < 1 or args.global_batch % w]
    if bad:
        parser.error(f"--worlds {bad}: W must divide --global-batch {args.global_batch}")
    for world in args.worlds:
        if (1, world, "ddp") not in layouts(world, experts):
            print(f"W={world}: does not divide every layer's experts ({sorted(set(experts))}): no 1 x {world} layout",
                  file=sys.stderr)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for world in args.worlds:
            results[world] = launch(world, args, Path(folder) / f"w{world}.json")
    report(results, args, spec.name)
    if args.json:
        args.json.write_text(json.dumps({str(w): r for w, r in results.items()}, indent=1))


if __name__ == "__main__":
    main()

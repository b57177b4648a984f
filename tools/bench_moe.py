"""Benchmark the MoE layer against a dense FFN of equal activated FLOPs, Soft MoE scaling, and whole models.

    python tools/bench_moe.py [--quick] [--device cpu|cuda] [--dtype fp32|bf16]
                              [--step auto|loop|padded|grouped_mm|triton] [--only layer|soft|model|groups|peers]
                              [--peers] [--threads N] [--load N] [--json out.json]

1. Layer: top-k MoE (E experts of width 4d, top-k) vs a dense FFN of width k * 4d on the same T tokens,
   d = 384, measured interleaved in one process; median ms and the ratio MoE / dense, forward and
   forward+backward, for the default step ("auto", which step it picks) and each forced step (loop, padded,
   grouped_mm), with auto / best forced and the pick's own forced time / best forced (whether auto chose
   well, apart from the noise of timing the same code twice): the figures `moespec/layers/steps/rule.py` is
   fitted on. At T = 197 also the weight-bandwidth floor: the bytes of the expert weights the batch needs, at
   the memory read bandwidth measured in the same run; the compute floor: the routed rows' FLOPs at the rate
   of a large square matmul measured in the same run (where it is above 1.5x the bandwidth floor, the layer
   cannot come within 1.5x of that floor); and the least the layer can take with torch's kernels: the larger
   of the bank on one row per expert (torch's batched matmuls reading those weights, far below the bandwidth
   at a few rows on CPU) and the dense FFN of equal FLOPs.
2. Soft MoE on 196 tokens: forward time with the total slots fixed at 196 while experts grow from 4 to 196
   (the paper's claim: cost follows slots, not experts), and with one slot per expert from 8 to 1024.
3. Models at batch 32: (MoE images/s) / (dense images/s) / (dense GMACs / MoE GMACs); 1.0 = no routing
   overhead.
4. Routing groups at T = 6304 (32 images of 197 tokens): the capacity-limited top-k (with and without BPR)
   and expert-choice layers routing each image alone (`group: image`) against the whole batch (`group:
   batch`): the router alone and the whole layer, forward, interleaved; ratio image / batch.
5. Peers (`--peers`, needs `pip install -e ".[bench]"`): the MoE blocks a user would pick instead
   (tools/moe_peers.py: transformers' Mixtral and Qwen3-MoE blocks, DeepSpeed's MoE at ep_size=1,
   lucidrains' mixture-of-experts (top-2 only) and st-moe-pytorch (top-n, n >= 2), both dropless through a
   capacity of the whole sequence, soft-moe-pytorch; torchtune where its release has an MoE), built with
   moespec's router and expert weights, each output checked against a per-expert reference, then timed
   interleaved at T = 6304, d = 384, expert width 1536; each ratio is to the dense FFN of its own family
   (SwiGLU or GELU MLP) with equal activated FLOPs. Then Soft MoE against soft-moe-pytorch from 8 to 1024
   experts, with one slot per expert and with 1024 slots in all. A peer that is not installed is skipped with
   a note.
With `--load N`, N busy processes (each a Python loop that never sleeps) run beside the benchmark for all of
it, as on a shared machine, laptop or CI runner; the load average before and after is printed and written to the
JSON. Run it once with and once without, and compare the ratios: a ratio to the dense FFN, both timed under the
same load, says what the load costs the MoE layer beyond what it costs dense matmuls.
Figures only: machines are noisy, so nothing here is a test.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from moe_peers import DIM, Peer, soft_peers, topk_peers  # tools/moe_peers.py, beside this script
from timm.layers import Mlp
from torch import nn

import moespec
from moespec.layers import ExpertChoiceRouter, Experts, LinearGate, MoE, SoftMoE, TopKRouter, set_expert_step
from moespec.layers.steps import EXPERT_STEPS

PEER_LIBRARIES = ("torch", "transformers", "deepspeed", "torchtune", "soft-moe-pytorch", "mixture-of-experts",
                  "st-moe-pytorch")
PEER_TOLERANCE = 1e-5  # max |output - reference| / max |reference|, fp32


def _time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median ms of each fn, run in turns after one warm-up each. The order rotates every round (a b c, b c a,
    c a b, ...): a fn that runs right after a similar one finds its weights in cache, so in a fixed order the
    same step timed twice differed by up to 10%, depending on what ran before it."""
    for fn in fns.values():
        fn()
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for turn in range(repeats):
        shift = turn % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name] += _time(fns[name], 1)
    return {name: statistics.median(values) for name, values in samples.items()}


STEPS = ("loop", "padded", "grouped_mm")  # the CPU's steps of the table (`moespec.layers.steps`)
FORCED_STEP = "auto"  # --step: the step of every layer outside the layer part, which times each


def layer_bench(device, dtype, quick: bool) -> list[dict]:
    """Top-k MoE against its equal-FLOP dense FFN, with the default step ("auto") and every forced step timed
    interleaved; at T = 197 also the weight-bandwidth floor (see `bandwidth_floor`)."""
    rows = []
    grid = [(e, k, t) for e in (8, 32) for k in (1, 2) for t in (197, 6304)]
    if quick:
        grid = [(8, 2, 197), (8, 2, 6304)]
    bandwidth, peak = read_bandwidth(device), matmul_rate(device, dtype)
    print(f"layer: memory read bandwidth {bandwidth / 1e9:.1f} GB/s (sum over a 1 GiB tensor, best of 5); matmul "
          f"{peak / 1e9:.0f} GFLOP/s (2048 x 2048 x 2048, best of 5)", flush=True)
    # the first setting timed in a process came out unlike itself timed again (E = 8, k = 1, T = 197: in some
    # processes the loop 3-7% ahead of padded in the first run, 15-20% behind it in the five runs after): a
    # discarded run first
    _layer_setting(*grid[0], device, dtype, bandwidth, peak)
    for experts, top_k, tokens in grid:
        row = _layer_setting(experts, top_k, tokens, device, dtype, bandwidth, peak)
        rows.append(row)
        print(f"layer E={experts:3d} k={top_k} T={tokens:5d} ratio to dense (auto picks {row['auto_fwd']} | "
              f"{row['auto_fwdbwd']}; {row['rows_per_expert']:.1f} rows per expert, padding {row['waste']:.2f}x)",
              flush=True)
        for label, name in (("fwd", "fwd    "), ("fwdbwd", "fwd+bwd")):
            forced = "  ".join(f"{s} {row[f'{label}_{s}_ratio']:.2f}x" for s in STEPS)
            print(f"    {name}: auto {row[f'{label}_auto_ratio']:.2f}x ({row[f'{label}_auto_ms']:.2f} ms vs dense "
                  f"{row[f'{label}_dense_ms']:.2f} ms)   {forced}   auto / best forced "
                  f"{row[f'{label}_auto_vs_best']:.3f} (its pick timed forced / best "
                  f"{row[f'{label}_pick_vs_best']:.3f})", flush=True)
        if "floor_fwd_ms" in row:
            print(f"    weight-bandwidth floor: {row['floor_bytes'] / 1e6:.1f} MB of expert weights read -> fwd "
                  f"{row['floor_fwd_ms']:.2f} ms (auto {row['fwd_auto_ms'] / row['floor_fwd_ms']:.2f}x the floor), "
                  f"fwd+bwd {row['floor_fwdbwd_ms']:.2f} ms "
                  f"({row['fwdbwd_auto_ms'] / row['floor_fwdbwd_ms']:.2f}x); the dense FFN, whose weights are "
                  f"{row['dense_floor_fwd_ms'] / row['floor_fwd_ms']:.2f}x as many bytes, runs at "
                  f"{row['fwd_dense_ms'] / row['dense_floor_fwd_ms']:.1f}x its own floor", flush=True)
            reach = "within" if row["compute_fwd_ms"] <= 1.5 * row["floor_fwd_ms"] else "beyond"
            print(f"    compute floor: {row['routed_flops'] / 1e6:.0f} MFLOP of routed rows at the matmul rate -> fwd "
                  f"{row['compute_fwd_ms']:.2f} ms ({row['compute_fwd_ms'] / row['floor_fwd_ms']:.2f}x the bandwidth "
                  f"floor: 1.5x it is {reach} reach); auto forward is "
                  f"{row['fwd_auto_ms'] / max(row['compute_fwd_ms'], row['floor_fwd_ms']):.2f}x the larger floor",
                  flush=True)
            one_row, bound = row["one_row_fwd_ms"], row["kernel_bound_fwd_ms"]
            print(f"    with torch's kernels: the bank on one row per expert (two bmm reading all {experts} experts' "
                  f"weights) takes {one_row:.2f} ms ({row['floor_fwd_ms'] / one_row:.2f}x the bandwidth floor's "
                  f"speed), the dense FFN of equal FLOPs {row['fwd_dense_ms']:.2f} ms; auto forward is "
                  f"{row['fwd_auto_ms'] / bound:.2f}x the larger", flush=True)
    return rows


def _layer_setting(experts: int, top_k: int, tokens: int, device, dtype, bandwidth: float, peak: float) -> dict:
    dim = 384
    torch.manual_seed(0)
    bank = Experts(experts, dim, 4 * dim, dim, act=nn.GELU())
    moe = MoE(TopKRouter(LinearGate(dim, experts), experts, top_k), bank).to(device, dtype)
    dense = Mlp(dim, top_k * 4 * dim).to(device, dtype)  # equal activated FLOPs
    x = torch.randn(1, tokens, dim, device=device, dtype=dtype, requires_grad=True)

    def fwd(step):
        def run():
            set_expert_step(bank, step)
            return moe(x)
        return run

    def fwd_bwd(step):
        def run():
            set_expert_step(bank, step)
            moe.zero_grad(set_to_none=True)  # as a training step's optimizer.zero_grad(): no accumulation pass
            x.grad = None
            moe(x).float().square().mean().backward()
        return run

    def dense_fwd_bwd():
        dense.zero_grad(set_to_none=True)
        x.grad = None
        dense(x).float().square().mean().backward()

    repeats = 15 if tokens > 1000 else 100  # a few ms a run at T = 197: noise of +-10% needs many
    steps = ("auto",) + STEPS
    fns = {**{s: fwd(s) for s in steps}, "dense": lambda: dense(x)}
    if tokens <= 1000:  # the bank on one row per expert: torch's batched matmuls reading every expert's weights
        one_row = x.new_zeros(experts, 1, dim)

        def one_row_bmm():
            set_expert_step(bank, "padded")  # equal segments, forced padded: the two bmm on one_row itself
            return bank.batched(one_row)

        fns["one_row"] = one_row_bmm
    with torch.no_grad():
        forward = interleaved(fns, repeats)
        picked_fwd = _picked(moe, x)
    backward = interleaved({**{s: fwd_bwd(s) for s in steps},
                            "dense": dense_fwd_bwd}, repeats)
    with torch.no_grad():
        counts = moe.router(x.reshape(-1, dim), 1).counts
    row = {"experts": experts, "top_k": top_k, "tokens": tokens, "auto_fwd": picked_fwd,
           "auto_fwdbwd": _picked(moe, x), "rows_per_expert": tokens * top_k / experts,
           "waste": experts * int(counts.max()) / (tokens * top_k)}  # padded's batch over the real rows
    for label, times in (("fwd", forward), ("fwdbwd", backward)):
        row[f"{label}_dense_ms"] = times["dense"]
        for step in steps:
            row[f"{label}_{step}_ms"] = times[step]
            row[f"{label}_{step}_ratio"] = times[step] / times["dense"]
        best = min(times[s] for s in STEPS)
        row[f"{label}_auto_vs_best"] = times["auto"] / best
        # auto is deterministic, so it runs its pick's code: the pick's forced time against the best says whether
        # the choice is right without the noise of timing the same code twice (both figures are reported)
        row[f"{label}_pick_vs_best"] = times[row[f"auto_{label}"]] / best
    if tokens <= 1000:
        row.update(bandwidth_floor(moe, x, bandwidth))
        row["routed_flops"] = 2 * tokens * top_k * bank.macs_per_item()  # fc1 + fc2 of each (item, expert) pair
        row["compute_fwd_ms"] = row["routed_flops"] / peak * 1e3
        row["one_row_fwd_ms"] = forward["one_row"]
        row["kernel_bound_fwd_ms"] = max(forward["one_row"], forward["dense"])  # reading the weights | the FLOPs
        row["dense_floor_fwd_ms"] = sum(p.numel() * p.element_size() for p in dense.parameters()) / bandwidth * 1e3
    return row


def _picked(moe: MoE, x: torch.Tensor) -> str:
    """The step "auto" takes for this layer's routed rows, in the current grad mode."""
    set_expert_step(moe.experts, "auto")
    with torch.no_grad():
        routing = moe.router(x.reshape(-1, x.shape[-1]), x.shape[0])
    rows = x.new_empty(routing.item.shape[0], x.shape[-1], requires_grad=torch.is_grad_enabled())
    return moe.experts.strategy(rows, routing.counts)


def read_bandwidth(device) -> float:
    """Bytes per second that a reduction reads from memory: sum over a 1 GiB fp32 tensor, best of 5."""
    big = torch.ones(2**28, device=device)
    best = min(_time(lambda: big.sum(), 1)[0] for _ in range(5))
    return big.numel() * big.element_size() / (best / 1e3)


def matmul_rate(device, dtype) -> float:
    """FLOP/s of a large square matmul (2048 x 2048 x 2048), best of 5: the most the experts' arithmetic can run
    at, so the least time the routed rows' FLOPs take."""
    a = torch.randn(2048, 2048, device=device, dtype=dtype)
    a @ a
    best = min(_time(lambda: a @ a, 1)[0] for _ in range(5))
    return 2 * 2048**3 / (best / 1e3)


def bandwidth_floor(moe: MoE, x: torch.Tensor, bandwidth: float) -> dict:
    """The least time the layer can take when reading weights bounds it (small T): the bytes of the gate and of
    every expert that gets at least one row, at the measured bandwidth. Forward reads them once; forward +
    backward reads them twice (the input gradient needs them) and writes their gradients once."""
    with torch.no_grad():
        routing = moe.router(x.reshape(-1, x.shape[-1]), x.shape[0])
    used = int((routing.counts > 0).sum())
    bank = moe.experts
    per_expert = sum(p[0].numel() * p.element_size() for p in bank.parameters())
    gate = sum(p.numel() * p.element_size() for p in moe.router.parameters())
    weight_bytes = used * per_expert + gate
    return {"experts_used": used, "floor_bytes": weight_bytes, "floor_fwd_ms": weight_bytes / bandwidth * 1e3,
            "floor_fwdbwd_ms": 3 * weight_bytes / bandwidth * 1e3}


def soft_bench(device, dtype, quick: bool) -> list[dict]:
    """Forward time of one Soft MoE layer on 8 images of 196 tokens: (a) total slots n * p fixed at 196 while
    the experts n grow (p = 196 / n), where the paper's claim is a flat cost; (b) one slot per expert, where
    the slots grow with the experts and so does the cost."""
    dim, rows = 384, []
    x = torch.randn(8, 196, dim, device=device, dtype=dtype)
    series = [("fixed_slots", e, 196 // e) for e in ((4, 196) if quick else (4, 7, 14, 28, 49, 98, 196))]
    series += [("one_slot_per_expert", e, 1) for e in ((8, 128) if quick else (8, 64, 256, 1024))]
    for name, experts, per_expert in series:
        layer = set_expert_step(SoftMoE(Experts(experts, dim, 4 * dim, dim, act=nn.GELU()), per_expert),
                                FORCED_STEP).to(device, dtype)
        with torch.no_grad():
            ms = statistics.median(_time(lambda layer=layer: layer(x), 5 if experts > 256 else 10))
        first = next(r for r in rows + [{"series": name, "fwd_ms": ms}] if r["series"] == name)
        rows.append({"series": name, "experts": experts, "slots": experts * per_expert, "fwd_ms": ms})
        print(f"soft   {name:19s} E={experts:5d} slots={experts * per_expert:5d}: fwd {ms:8.2f} ms "
              f"({ms / first['fwd_ms']:.2f}x of the first)", flush=True)
    return rows


def model_bench(device, dtype, quick: bool) -> list[dict]:
    rows = []
    pairs = [("vit_s16_moe8_every2_top2", "vit_s16_dense"), ("convnext_t_moe4_last2_top1", "convnext_t_dense")]
    batch = 8 if quick else 32
    for moe_name, dense_name in pairs:
        specs = {n: moespec.load_spec(f"specs/{n}.yaml") for n in (moe_name, dense_name)}
        models = {n: moespec.create_model(s, expert_step=FORCED_STEP).to(device, dtype).eval()
                  for n, s in specs.items()}
        gmacs = {n: moespec.stats(s).gmacs for n, s in specs.items()}
        x = torch.randn(batch, 3, 224, 224, device=device, dtype=dtype)
        with torch.no_grad():
            ms = interleaved({n: (lambda m=m, x=x: m(x)) for n, m in models.items()}, 3 if quick else 5)
        throughput = {n: batch / (t / 1e3) for n, t in ms.items()}
        figure = throughput[moe_name] / throughput[dense_name] / (gmacs[dense_name] / gmacs[moe_name])
        rows.append({"moe": moe_name, "dense": dense_name, "batch": batch, "moe_img_s": throughput[moe_name],
                     "dense_img_s": throughput[dense_name], "moe_gmacs": gmacs[moe_name],
                     "dense_gmacs": gmacs[dense_name], "overhead_figure": figure})
        print(f"model {moe_name}: {throughput[moe_name]:.1f} img/s vs {throughput[dense_name]:.1f} img/s dense; "
              f"GMACs {gmacs[moe_name]:.2f} vs {gmacs[dense_name]:.2f}; figure {figure:.3f} (1.0 = no overhead)",
              flush=True)
    return rows


def group_bench(device, dtype, quick: bool) -> list[dict]:
    dim, experts, images, tokens, rows = 384, 8, 32, 197, []
    routers = {
        "topk k=2 cf=1.25": lambda group: TopKRouter(LinearGate(dim, experts), experts, 2, capacity_factor=1.25,
                                                     group=group),
        "topk k=1 cf=1.0 bpr": lambda group: TopKRouter(LinearGate(dim, experts), experts, 1, capacity_factor=1.0,
                                                        bpr=True, group=group),
        "expert choice c=1": lambda group: ExpertChoiceRouter(LinearGate(dim, experts), experts, 1.0, group=group),
    }
    x = torch.randn(images, tokens, dim, device=device, dtype=dtype)
    items = x.reshape(-1, dim)
    for name, make in routers.items():
        layers = {}
        for label, group in (("image", 1), ("batch", None)):
            torch.manual_seed(0)
            layers[label] = set_expert_step(MoE(make(group), Experts(experts, dim, 4 * dim, dim, act=nn.GELU())),
                                            FORCED_STEP).to(device, dtype)
            layers[label].eval()
        repeats = 5 if quick else 15
        with torch.no_grad():
            route = interleaved({label: (lambda m=m: m.router(items, images)) for label, m in layers.items()}, repeats)
            layer = interleaved({label: (lambda m=m: m(x)) for label, m in layers.items()}, repeats)
        rows.append({"router": name, "tokens": images * tokens, "route_image_ms": route["image"],
                     "route_batch_ms": route["batch"], "route_ratio": route["image"] / route["batch"],
                     "layer_image_ms": layer["image"], "layer_batch_ms": layer["batch"],
                     "layer_ratio": layer["image"] / layer["batch"]})
        print(f"groups {name:20s} T={images * tokens}: routing {route['image']:7.2f} / {route['batch']:7.2f} ms = "
              f"{rows[-1]['route_ratio']:.2f}x   layer {layer['image']:8.2f} / {layer['batch']:8.2f} ms = "
              f"{rows[-1]['layer_ratio']:.2f}x  (group image / group batch)", flush=True)
    return rows


def peer_bench(device, dtype, quick: bool) -> dict:
    """moespec against its peers on 32 images of 197 tokens: top-k at E in {8, 32}, k in {1, 2} (SwiGLU and
    GELU families), and Soft MoE with 192 slots at E in {8, 32}."""
    images, per_image = 32, 197
    x = torch.randn(images, per_image, DIM, device=device, dtype=dtype)
    repeats = 3 if quick else 9
    rows, skipped = [], []
    for experts, top_k in [(8, 2)] if quick else [(e, k) for e in (8, 32) for k in (1, 2)]:
        peers = []
        for family in ("swiglu", "gelu"):
            built, missing = topk_peers(family, experts, top_k)
            peers += built
            skipped += [{"name": m.name, "experts": experts, "top_k": top_k, "reason": m.reason} for m in missing]
        rows += _time_peers(peers, x, repeats, {"kind": "topk", "experts": experts, "top_k": top_k})
    for experts in (8,) if quick else (8, 32):
        peers, missing = soft_peers(experts, 192, per_image)
        skipped += [{"name": m.name, "experts": experts, "reason": m.reason} for m in missing]
        rows += _time_peers(peers, x, repeats, {"kind": "soft", "experts": experts, "slots": 192})
    sweep, sweep_skipped = soft_sweep(device, dtype, quick)
    skipped += sweep_skipped
    for name, reason in dict.fromkeys((skip["name"], skip["reason"]) for skip in skipped):  # once each
        print(f"peers: skipped {name}: {reason}", flush=True)
    return {"tokens": images * per_image, "rows": rows, "soft_sweep": sweep, "skipped": skipped,
            "versions": _versions()}


def soft_sweep(device, dtype, quick: bool) -> tuple[list[dict], list[dict]]:
    """Soft MoE against soft-moe-pytorch on 8 images of 196 tokens as the experts grow from 8 to 1024: one slot
    per expert (the slots grow with the experts), and 1024 slots in all (fewer slots per expert as they grow)."""
    x = torch.randn(8, 196, DIM, device=device, dtype=dtype)
    counts = (8, 128) if quick else (8, 32, 128, 512, 1024)
    rows, skipped = [], []
    for series, slots_of in (("one_slot_per_expert", lambda e: e), ("fixed_1024_slots", lambda e: 1024)):
        for experts in counts:
            peers, missing = soft_peers(experts, slots_of(experts), x.shape[1])
            skipped += [{"name": m.name, "experts": experts, "reason": m.reason} for m in missing]
            setting = {"kind": "soft", "series": series, "experts": experts, "slots": slots_of(experts)}
            timed = _time_peers(peers, x, 3 if experts >= 512 else 5, setting)
            rows += timed
            del peers
            named = {r["name"]: r for r in timed}
            ours, theirs = named["moespec soft"], named.get("soft-moe-pytorch", {})
            if "fwd_ms" in ours and "fwd_ms" in theirs:
                fwd, fwd_bwd = (ours[key] / theirs[key] for key in ("fwd_ms", "fwdbwd_ms"))
                print(f"peers soft {series} E={experts}: moespec / soft-moe-pytorch fwd {fwd:.2f}x, fwd+bwd "
                      f"{fwd_bwd:.2f}x", flush=True)
    return rows, skipped


def _time_peers(peers: list[Peer], x: torch.Tensor, repeats: int, setting: dict) -> list[dict]:
    """Check each peer against its reference, then time the ones that pass with the dense baselines,
    interleaved; ratio = ms / ms of the dense FFN of the peer's family. Gradients are dropped before each
    backward (set_to_none, as torch's zero_grad does by default), so every backward writes fresh ones, as in
    a training step, and only one module holds gradients at a time."""
    checked = []
    for peer in peers:
        peer.module.to(x.device, x.dtype)
        error = None
        if peer.reference is not None:
            with torch.no_grad():
                reference = peer.reference(x)
                error = ((peer.module(x) - reference).abs().max() / reference.abs().max()).item()
        checked.append((peer, error))
    timed = {p.name: p for p, error in checked if error is None or error <= PEER_TOLERANCE}
    inputs = x.detach().requires_grad_()
    with torch.no_grad():
        forward = interleaved({name: (lambda m=p.module: m(x)) for name, p in timed.items()}, repeats)
    backward = interleaved({name: (lambda m=p.module: _train_step(m, inputs)) for name, p in timed.items()}, repeats)
    rows = []
    for peer, error in checked:
        row = {**setting, "name": peer.name, "family": peer.family, "check_error": error}
        if peer.name in timed:
            baseline = f"dense {peer.family}"
            row.update(fwd_ms=forward[peer.name], fwd_ratio=forward[peer.name] / forward[baseline],
                       fwdbwd_ms=backward[peer.name], fwdbwd_ratio=backward[peer.name] / backward[baseline])
            check = "baseline" if error is None else f"check {error:.1e}"
            print(f"peers {_setting_label(setting):12s} {peer.name:28s} fwd {row['fwd_ms']:9.1f} ms "
                  f"{row['fwd_ratio']:5.2f}x   fwd+bwd {row['fwdbwd_ms']:9.1f} ms {row['fwdbwd_ratio']:5.2f}x   "
                  f"({check})", flush=True)
        else:
            print(f"peers {_setting_label(setting):12s} {peer.name:28s} NOT TIMED: output differs from its "
                  f"reference by {error:.1e} (> {PEER_TOLERANCE})", flush=True)
        rows.append(row)
    return rows


def _train_step(module: nn.Module, x: torch.Tensor) -> None:
    module.zero_grad(set_to_none=True)
    x.grad = None
    module(x).float().square().mean().backward()


def _setting_label(setting: dict) -> str:
    if setting["kind"] == "soft":
        return f"soft E={setting['experts']} S={setting['slots']}"
    return f"E={setting['experts']} k={setting['top_k']}"


def _versions() -> dict[str, str | None]:
    versions = {}
    for name in PEER_LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


@contextlib.contextmanager
def busy_processes(count: int):
    """`count` processes that keep a core busy (a Python loop that never sleeps) for the length of the block."""
    workers = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        if workers:
            time.sleep(2.0)  # let the scheduler see them
        yield
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few settings only")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--step", default="auto", choices=["auto", *EXPERT_STEPS],
                        help="force the experts' step outside the layer part, which times them all (default: "
                             "picked by device, dtype and size)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--only", choices=["layer", "soft", "model", "groups", "peers"], action="append")
    parser.add_argument("--peers", action="store_true",
                        help="time the peers' MoE blocks (alone, or with the parts --only names)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--load", type=int, default=0,
                        help="run N busy processes beside the benchmark (a loaded machine), default 0")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    parts = (args.only or ([] if args.peers else ["layer", "soft", "model", "groups"])) + (["peers"] * args.peers)
    global FORCED_STEP
    FORCED_STEP = args.step
    results = {"device": args.device, "dtype": args.dtype, "step": args.step,
               "threads": torch.get_num_threads(), "busy_processes": args.load, "cores": os.cpu_count()}
    with busy_processes(args.load):
        results["load_average_before"] = os.getloadavg()[0]
        print(f"load: {args.load} busy processes beside the benchmark on {os.cpu_count()} cores, "
              f"{torch.get_num_threads()} torch threads; load average {results['load_average_before']:.2f}", flush=True)
        for part, fn in (("layer", layer_bench), ("soft", soft_bench), ("model", model_bench),
                         ("groups", group_bench), ("peers", peer_bench)):
            if part in parts:
                results[part] = fn(args.device, dtype, args.quick)
        results["load_average_after"] = os.getloadavg()[0]
        print(f"load: load average {results['load_average_after']:.2f} at the end", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

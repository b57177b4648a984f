"""Time the triton step's scattered kernels on a GPU under candidate tile configs, and check its bf16 gradients.

    python tools/tune_fused.py [--experts 8 32] [--top-k 2] [--tokens 50432] [--repeats 10]

For a top-k layer at ViT-B width (d = 768, expert width 3072, GELU experts with biases, bf16 weights), each
candidate config is set on every kernel at once (`kernels.scattered.CONFIGS`); one forward+backward is run
`--repeats` times and each kernel launch is timed with CUDA events around it (`kernels.scattered._row_launch`),
as are the weight gradients (`ops.scattered._weight_gradients`: torch's grouped GEMM or the Triton kernel).
Printed: the median ms and TFLOP/s of each kernel under each config, the best config per kernel, and the relative
error of the triton step's output and gradients against the grouped_mm step's (the bf16 gate-gradient fault of
the first GPU run). A config that fails to compile or launch is reported and skipped.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moespec.layers.experts import Experts  # noqa: E402
from moespec.layers.kernels import scattered as kernels  # noqa: E402
from moespec.layers.moe import MoE  # noqa: E402
from moespec.layers.ops import scattered  # noqa: E402
from moespec.layers.routers import LinearGate, TopKRouter  # noqa: E402
from moespec.layers.steps import set_expert_step  # noqa: E402

KERNELS = ("fc1", "fc2", "fc2_backward", "fc1_backward")
CANDIDATES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M)
    (128, 128, 64, 8, 3, 8), (128, 128, 64, 8, 3, 1), (128, 64, 64, 8, 3, 8), (128, 128, 64, 8, 4, 8),
    (128, 256, 64, 8, 3, 8), (256, 128, 64, 8, 3, 8), (128, 128, 64, 4, 4, 8), (64, 128, 64, 4, 4, 8),
    (128, 128, 32, 8, 5, 8),
]


def config_of(candidate) -> dict[str, int]:
    m, n, k, warps, stages, group = candidate
    return {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "num_warps": warps, "num_stages": stages, "GROUP_M": group}


def label(candidate) -> str:
    m, n, k, warps, stages, group = candidate
    return f"{m}x{n}x{k} w{warps} s{stages} g{group}"


class Timer:
    """CUDA events around each launch of `kernels._row_launch` (by config name) and `scattered._weight_gradients`."""

    def __init__(self):
        self.events: dict[str, list] = {}
        self.row_launch, self.weight_gradients = kernels._row_launch, scattered._weight_gradients

    def __enter__(self):
        def row_launch(kernel, name, *args, **flags):
            return self._timed(name, self.row_launch, kernel, name, *args, **flags)

        def weight_gradients(*args):
            return self._timed("weight_gradients", self.weight_gradients, *args)

        kernels._row_launch, scattered._weight_gradients = row_launch, weight_gradients
        return self

    def __exit__(self, *exc):
        kernels._row_launch, scattered._weight_gradients = self.row_launch, self.weight_gradients

    def _timed(self, name, fn, *args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args, **kwargs)
        end.record()
        self.events.setdefault(name, []).append((start, end))
        return out

    def medians(self) -> dict[str, float]:
        torch.cuda.synchronize()
        return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in self.events.items()}


def layer(experts: int, top_k: int, dim: int, hidden: int, capacity=None) -> MoE:
    torch.manual_seed(0)
    bank = Experts(experts, dim, hidden, dim, act=nn.GELU())
    moe = MoE(TopKRouter(LinearGate(dim, experts), experts, top_k, capacity_factor=capacity), bank)
    with torch.no_grad():
        for p in moe.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return moe


def train_step(moe: MoE, x: torch.Tensor, upstream: torch.Tensor):
    moe.zero_grad(set_to_none=True)
    xg = x.detach().clone().requires_grad_()
    y = moe(xg)
    (y.float() * upstream).sum().backward()
    return y.detach().float(), [xg.grad] + [p.grad for p in moe.parameters()]


def agreement(experts: int, top_k: int, capacity=None, dim=768, hidden=3072, tokens=197 * 8) -> str:
    """max over output and gradients of max |triton - grouped_mm| / max |grouped_mm|, bf16, with the worst name."""
    moe = layer(experts, top_k, dim, hidden, capacity).cuda().to(torch.bfloat16).train()
    x = torch.randn(tokens // 197, 197, dim, device="cuda", dtype=torch.bfloat16)
    upstream = torch.randn(x.shape, device="cuda")
    results = {}
    for step in ("grouped_mm", "triton"):
        set_expert_step(moe.experts, step)
        results[step] = train_step(moe, x, upstream)
    names = ["y", "x"] + [n for n, _ in moe.named_parameters()]
    got = [results["triton"][0]] + results["triton"][1]
    want = [results["grouped_mm"][0]] + results["grouped_mm"][1]
    errors = {n: ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()
              for n, a, b in zip(names, got, want, strict=True) if b is not None}
    worst = max(errors, key=errors.get)
    return f"{errors[worst]:.1e} ({worst})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=50432)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--candidates", nargs="+", metavar="MxNxK:W:S:G",
                        help="configs to time instead of the built-in list, e.g. 64x128x64:8:4:8")
    args = parser.parse_args()
    candidates = CANDIDATES
    if args.candidates:
        candidates = [(*map(int, shape.split("x")), *map(int, rest)) for shape, *rest in
                      (c.split(":") for c in args.candidates)]
    dim, hidden = 768, 3072
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}")
    print("agreement triton vs grouped_mm, bf16 (output and every gradient; worst named):")
    for experts, top_k, capacity in ((8, 2, None), (8, 1, None), (8, 2, 1.0), (128, 2, None)):
        try:
            print(f"  E{experts} k{top_k} capacity {capacity}: {agreement(experts, top_k, capacity)}", flush=True)
        except Exception as error:  # noqa: BLE001 -- report, go on
            print(f"  E{experts} k{top_k} capacity {capacity}: failed: {str(error)[:300]}", flush=True)
    rows = args.tokens * args.top_k
    flops = {name: 2 * rows * dim * hidden for name in KERNELS}
    flops["weight_gradients"] = 2 * 2 * rows * dim * hidden
    default = {name: dict(kernels.CONFIGS[name]) for name in KERNELS}
    best: dict[tuple, dict[str, float]] = {}
    for experts in args.experts:
        moe = layer(experts, args.top_k, dim, hidden).cuda().to(torch.bfloat16).train()
        set_expert_step(moe.experts, "triton")
        x = torch.randn(args.tokens // 197, 197, dim, device="cuda", dtype=torch.bfloat16)
        upstream = torch.randn(x.shape, device="cuda")
        print(f"\nE={experts} k={args.top_k} T={args.tokens} d={dim} h={hidden} bf16: median ms (TFLOP/s) per launch")
        print(f"{'config':22s} " + " ".join(f"{n:>17s}" for n in (*KERNELS, "weight_gradients")) + "  compile s")
        for candidate in [None, *candidates]:
            for name in KERNELS:
                kernels.CONFIGS[name] = dict(default[name]) if candidate is None else config_of(candidate)
            try:
                start = time.perf_counter()
                train_step(moe, x, upstream)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - start
                train_step(moe, x, upstream)
                with Timer() as timer:
                    for _ in range(args.repeats):
                        train_step(moe, x, upstream)
                ms = timer.medians()
            except Exception as error:  # noqa: BLE001 -- a config that does not fit: report, go on
                print(f"{label(candidate) if candidate else 'default':22s} failed: {str(error)[:200]}", flush=True)
                continue
            cells = []
            for name in (*KERNELS, "weight_gradients"):
                t = ms.get(name, float("nan"))
                cells.append(f"{t:7.3f} ({flops[name] / t / 1e9:4.0f})")
                if candidate is not None and name in KERNELS and t < best.get((experts, name), {}).get("ms", 1e9):
                    best[(experts, name)] = {"ms": t, "config": label(candidate),
                                             "tflops": flops[name] / t / 1e9}
            print(f"{label(candidate) if candidate else 'default':22s} " + " ".join(f"{c:>17s}" for c in cells)
                  + f"  {compile_s:6.1f}", flush=True)
        for name in KERNELS:
            kernels.CONFIGS[name] = default[name]
    print("\nbest per kernel:")
    for (experts, name), row in sorted(best.items()):
        print(f"  E={experts:3d} {name:14s} {row['config']:22s} {row['ms']:7.3f} ms {row['tflops']:5.0f} TFLOP/s")


if __name__ == "__main__":
    main()

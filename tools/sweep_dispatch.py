"""Sweep the expert bank alone over rows per expert and how unevenly they are spread: the figures that
`moespec/layers/steps/rule.py`'s CPU rule is fitted on.

    python tools/sweep_dispatch.py [--quick] [--threads N] [--json out.json]

For E in {8, 32} experts of ViT-S width (384 -> 1536 -> 384, GELU) and a mean of m rows per expert, the
segments are drawn as a multinomial over the experts (even, as an untrained router spreads them) and with one
expert taking `spread` times the mean (uneven). Each forced step (loop, padded, grouped_mm) is timed
interleaved, forward (no grad) and forward+backward; printed: the padding waste (E x largest / rows), each
step's median ms, auto's pick and its time over the best forced step's (1.00 = auto picked the fastest).
Figures only: machines are noisy, so nothing here is a test.
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_moe import STEPS, interleaved  # tools/bench_moe.py, beside this script
from torch import nn

from moespec.layers import Experts, set_expert_step

DIM = 384


def segments(experts: int, mean: int, spread: float | None, seed: int) -> torch.Tensor:
    """Rows per expert summing to experts * mean: multinomial over even odds (spread None), or expert 0 taking
    spread * mean rows and the others sharing the rest evenly."""
    rows = experts * mean
    if spread is None:
        draws = torch.randint(experts, (rows,), generator=torch.Generator().manual_seed(seed))
        return torch.bincount(draws, minlength=experts)
    largest = min(rows, round(spread * mean))
    counts = torch.full((experts,), (rows - largest) // (experts - 1))
    counts[1:1 + (rows - largest) % (experts - 1)] += 1
    counts[0] = largest
    return counts


def setting(bank: Experts, counts: torch.Tensor, repeats: int) -> dict:
    x = torch.randn(int(counts.sum()), DIM, requires_grad=True)

    def forward(step):
        def run():
            set_expert_step(bank, step)
            with torch.no_grad():
                bank(x, counts)
        return run

    def forward_backward(step):
        def run():
            set_expert_step(bank, step)
            bank.zero_grad(set_to_none=True)
            x.grad = None
            bank(x, counts).square().mean().backward()
        return run

    set_expert_step(bank, "auto")
    with torch.no_grad():
        pick_fwd = bank.strategy(x, counts)
    pick_fwdbwd = bank.strategy(x, counts)
    row = {"experts": bank.num_experts, "mean": x.shape[0] / bank.num_experts,
           "waste": bank.num_experts * int(counts.max()) / max(1, x.shape[0])}
    for label, make, pick in (("fwd", forward, pick_fwd), ("fwdbwd", forward_backward, pick_fwdbwd)):
        times = interleaved({step: make(step) for step in STEPS}, repeats)
        row[label] = times
        row[f"{label}_auto"] = pick
        row[f"{label}_auto_vs_best"] = times[pick] / min(times.values())
    set_expert_step(bank, "auto")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few settings only")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    means = (6, 25, 128) if args.quick else (4, 6, 12, 25, 50, 96, 128, 197)
    spreads = (None, 2.0) if args.quick else (None, 1.5, 2.0, 3.0)
    rows = []
    for experts in (8, 32):
        torch.manual_seed(0)
        bank = Experts(experts, DIM, 4 * DIM, DIM, act=nn.GELU())
        for mean in means:
            for spread in spreads:
                counts = segments(experts, mean, spread, seed=experts * 1000 + mean)
                row = setting(bank, counts, repeats=30 if mean < 64 else 10)
                rows.append(row)
                cells = []
                for label in ("fwd", "fwdbwd"):
                    steps = " ".join(f"{step} {row[label][step]:7.2f}" for step in STEPS)
                    cells.append(f"{label:6s} {steps} ms, auto {row[f'{label}_auto']:10s} "
                                 f"{row[f'{label}_auto_vs_best']:.2f}x the best")
                print(f"E={experts:2d} m={mean:3d} waste {row['waste']:4.2f}  " + "  |  ".join(cells), flush=True)
    worst = max(max(row["fwd_auto_vs_best"], row["fwdbwd_auto_vs_best"]) for row in rows)
    print(f"auto's pick, timed, over the best forced step: at most {worst:.2f}x in {len(rows)} settings")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

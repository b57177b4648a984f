"""Which expert step a bank runs under "auto" (the chooser, `steps.choose`): a fixed rule per device, fitted on the
benchmark.

    grouped_mm  one kernel over the jagged per-expert segments (`F.grouped_mm`, no host sync)
    padded      rows scattered into [E, max count, C] and two batched matmuls
    loop        one dense matmul per expert segment
    triton      (forced only, `set_expert_step(model, "triton")`; never picked here) the scattered Triton kernels
                of `ops/scattered.py`: on an H200 faster than grouped_mm in some forwards at T = 12608 and slower
                in every forward+backward (docs/gpu.md), so not yet a default

The rule is a pure function of the layer call's `Mode` (the device's path, whether autograd records the forward),
the dtype, the widths, the experts stacked in the bank and the rows routed to them. The same inputs always give
the same step, so a run stays bit-reproducible: the steps agree to float rounding, not bit for bit, and nothing
here times anything.

CPU, with m the mean rows per expert:
- from m = 128 on, the loop: each expert's matmul runs at the BLAS's full speed, and its whole FFN runs while
  the hidden activations are in cache;
- below, padded while the padded batch (E x the largest segment) is at most max(1, 1.5 + 10 / m - m / 256)
  times the rows: small matmuls are bound by reading the weights, and a batched matmul, which splits the
  experts between the threads, runs a padded row faster than one small matmul after another runs a real one.
  The fewer the rows per expert, the more padding pays;
- past that bound, grouped_mm when autograd records the forward (it writes every weight gradient with one
  matmul per expert), else the loop; the loop wherever grouped_mm cannot run (float64, rows not 16-byte
  aligned, torch < 2.9).
Under a TorchScript trace (fvcore's `FlopCountAnalysis`), the loop: a trace bakes the segments in anyway, and
its expert ops are then the work that `moespec stats` counts, with no padding rows.
The crossovers move with the CPU. The figures the rule was fitted on are in docs/dispatch.md;
`tools/sweep_dispatch.py` and `tools/bench_moe.py --only layer` measure them again.

Everywhere but on CPU, and while torch.compile or torch.export traces (`Mode.sync_free`): grouped_mm, the one
step with static shapes and no host sync (`ops/grouped.py`: F.grouped_mm, in the autocast dtype under autocast;
its fast CUDA kernels are bf16 on Hopper or newer). The routing takes the same path there: a capacity's dropped pairs
stay, with weight 0, after the experts' segments (`routing.group_pairs`), so that no shape depends on the data.
"""

from __future__ import annotations

import torch

from ..ops.grouped import GROUPED_DTYPES, has_grouped_mm
from ..ops.mode import Mode

CPU_LOOP_FROM = 128  # mean rows per expert from which the loop is the fastest step on CPU
CPU_EQUAL_LOOP_FROM = (128, 512)  # equal segments (no padding): the loop from here, forward | autograd records
CPU_PADDED_WASTE = (1.5, 10.0, 1 / 256)  # below: padded while E x largest <= max(1, 1.5 + 10/m - m/256) x rows


def auto_step(rows: int, dtype: torch.dtype, counts: torch.Tensor, aligned: bool, mode: Mode) -> str:
    """The step for `rows` rows of `dtype`, sorted by expert, `counts` [E] rows per local expert, in a call that
    runs as `mode` says (the sync-free path, a TorchScript trace, whether autograd records).

    Args:
        aligned: every weight row stride is a multiple of 16 bytes (grouped_mm's kernels need it).
    """
    if mode.sync_free:
        return "grouped_mm"
    if mode.scripted:  # fvcore's trace: the ops that run are the work counted, with no padding rows
        return "loop"
    grouped = aligned and has_grouped_mm() and dtype in GROUPED_DTYPES
    experts = counts.numel()
    if rows >= CPU_LOOP_FROM * experts:
        return "loop"
    base, few, many = CPU_PADDED_WASTE  # E * largest <= (base + few / m - many * m) * rows, m = rows / E:
    largest = int(counts.max()) if experts else 0
    if experts * largest <= max(rows, base * rows + few * experts - many * rows * rows / experts):  # even: padded
        return "padded"
    return "grouped_mm" if grouped and mode.records else "loop"


def equal_segments_step(rows: int, mode: Mode) -> str:
    """The step for segments of `rows` rows each (Soft MoE's slots), which need no padding: "padded" is then
    two bmm on the rows themselves, with no scatter, no gather and no waste, so it holds longer than on uneven
    segments. On CPU the loop from 128 rows per expert in a forward that autograd does not record, from 512 in
    one that it does (docs/dispatch.md); elsewhere the bmm."""
    if mode.sync_free:
        return "padded"
    return "loop" if rows >= CPU_EQUAL_LOOP_FROM[mode.records] else "padded"

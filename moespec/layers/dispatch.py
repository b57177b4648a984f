"""Which expert step `Experts` runs under `dispatch="auto"`: a fixed rule per device, fitted on the benchmark.

    grouped_mm  one kernel over the jagged per-expert segments (`F.grouped_mm`, no host sync)
    padded      rows scattered into [E, max count, C] and two batched matmuls
    loop        one dense matmul per expert segment

The rule is a pure function of the device, the dtype, the widths, the experts stacked in the bank and the
rows routed to them. The same inputs always give the same step, so a run stays bit-reproducible: the steps
agree to float rounding, not bit for bit, and nothing here times anything.

CPU, fitted on `python tools/bench_moe.py --only layer` and on a sweep of the bank alone over the mean rows
per expert m (4 to 788) and how unevenly they are spread (the largest segment up to 9x the mean), fp32,
2 threads, AMD EPYC (Zen 4, AVX-512), torch 2.14, forward and forward+backward timed interleaved:

- From a mean of 128 rows per expert on, the loop was the fastest in every setting, even segments included
  (E = 8, m = 788: 86 ms against padded's 104 and grouped_mm's 128, forward): each expert's matmul runs at
  the BLAS's full speed and its whole FFN runs while the hidden activations are in cache.
- Below, the matmuls are small, and a batched matmul (`bmm`, which splits the experts between the threads)
  ran a padded row 1.2-2x faster than grouped_mm or the loop (one small matmul after another, each split
  between the threads) ran a real one. Padded pays for every row up to the largest segment, so it wins while
  that waste is small: the padded batch E x largest at most (1.25 + 4 / m) times the real rows. The fewer
  the rows, the more waste pays (the small matmuls are bound by reading the weights, not by arithmetic): at
  E = 32, m = 6 padded ran 1.8x the real rows 1.7x faster than grouped_mm in forward and 1.9x in
  forward+backward. Past that waste, grouped_mm (about the loop's speed in forward, 5-20% faster in
  forward+backward at E = 32, as it writes every weight gradient with one matmul per expert).

The rule: the loop from a mean of 128 rows per expert; below, padded while its waste is within the bound,
grouped_mm past it (the loop where grouped_mm cannot run: float64, rows not 16-byte aligned, torch < 2.9).
This CPU's rule was refitted from an earlier machine's, which had found grouped_mm ahead of padded on
uneven segments of a few dozen rows: the crossovers move with the CPU, the order of the steps did not.

CUDA: grouped_mm in bf16 on Hopper or newer (its fast kernels); padded otherwise, which keeps every step on
the device, where the loop's per-expert launches and host sync cost most.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CPU_LOOP_FROM = 128  # mean rows per expert from which the loop is the fastest step on CPU
CPU_PADDED_WASTE = (1.25, 4.0)  # padded while E x largest segment <= (1.25 + 4 / mean) x rows, below that
GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what F.grouped_mm takes (not float64)


def has_grouped_mm() -> bool:
    """Whether this torch has the public grouped matmul (torch >= 2.9)."""
    return hasattr(F, "grouped_mm")


def auto_step(x: torch.Tensor, counts: torch.Tensor, aligned: bool) -> str:
    """The step for rows x [S, C] sorted by expert, `counts` [E] rows per local expert.

    Args:
        aligned: every weight row stride is a multiple of 16 bytes (grouped_mm's kernels need it).
    """
    grouped = aligned and has_grouped_mm() and x.dtype in GROUPED_DTYPES
    if x.is_cuda:
        hopper = torch.cuda.get_device_capability(x.device) >= (9, 0)
        return "grouped_mm" if grouped and x.dtype == torch.bfloat16 and hopper else "padded"
    rows, experts = x.shape[0], counts.numel()
    if rows >= CPU_LOOP_FROM * experts:
        return "loop"
    base, per_mean = CPU_PADDED_WASTE  # E * largest / rows <= base + per_mean * E / rows, times rows:
    if experts * (int(counts.max()) if experts else 0) <= base * rows + per_mean * experts:
        return "padded"
    return "grouped_mm" if grouped else "loop"

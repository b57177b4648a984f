"""Which expert step `Experts` runs under `dispatch="auto"`: a fixed rule per device, fitted on the benchmark.

    grouped_mm  one kernel over the jagged per-expert segments (`F.grouped_mm`, no host sync)
    padded      rows scattered into [E, max count, C] and two batched matmuls
    loop        one dense matmul per expert segment

The rule is a pure function of the device, the dtype, the widths, the experts stacked in the bank and the
rows routed to them. The same inputs always give the same step, so a run stays bit-reproducible: the steps
agree to float rounding, not bit for bit, and nothing here times anything.

CPU, fitted on `python tools/bench_moe.py --only layer` and on sweeps of its settings over the mean rows
per expert and over how unevenly they are spread (fp32, 2 threads). From about a hundred rows per expert on,
the loop is the fastest or within 4%: each expert's matmul runs at the BLAS's full speed, and it runs each
expert's whole FFN while the hidden activations are in cache. Below, with a few dozen rows per expert, what
differs is the work around the matmuls. grouped_mm, one C++ call over all segments,
was the fastest or within 5% of it at every mean below 64 rows per expert, up to 1.6x ahead of padded
(E = 32, k = 1, T = 197, forward), whose bmm pays for the padding up to the largest segment; but when the
segments are nearly even (the largest at most 10% above the mean, as under expert-choice routing or a
capacity that most experts fill) and hold 16 rows or more, padded's one batched matmul was 1-17% ahead of
grouped_mm in forward and ahead or within 3% in forward+backward (E = 8 and 32, 25-75 rows per expert;
from 20% above the mean on, grouped_mm was even or ahead, up to 1.3x). So:
the loop from a mean of 64 rows per expert; below, padded for even segments of 16 rows or more, grouped_mm
otherwise; padded wherever grouped_mm cannot run (float64, rows not 16-byte aligned, torch < 2.9). The CPU
behind this machine changes: an earlier fit, on one with 30% more memory bandwidth (33.8 vs 26.1 GB/s),
had found padded the fastest at T = 197, and the rule follows the newest measurement.

CUDA: grouped_mm in bf16 on Hopper or newer (its fast kernels); padded otherwise, which keeps every step on
the device, where the loop's per-expert launches and host sync cost most.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CPU_GROUPED_BELOW = 64  # mean rows per expert below which grouped_mm or padded beats the loop on CPU
CPU_PADDED_FROM = 16  # ... and from which padded beats grouped_mm on even segments
CPU_PADDED_WASTE = 0.10  # even: the padded batch [E, largest segment] at most 10% more rows than there are
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
    if rows >= CPU_GROUPED_BELOW * experts:
        return "loop"
    if not grouped:
        return "padded"
    even = rows >= CPU_PADDED_FROM * experts and experts * int(counts.max()) <= (1 + CPU_PADDED_WASTE) * rows
    return "padded" if even else "grouped_mm"

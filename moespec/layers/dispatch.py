"""Which expert step `Experts` runs under `dispatch="auto"`: a fixed rule per device, fitted on the benchmark.

    grouped_mm  one kernel over the jagged per-expert segments (`F.grouped_mm`, no host sync)
    padded      rows scattered into [E, max count, C] and two batched matmuls
    loop        one dense matmul per expert segment

The rule is a pure function of the device, the dtype, the widths, the experts stacked in the bank and the
rows routed to them. The same inputs always give the same step, so a run stays bit-reproducible: the steps
agree to float rounding, not bit for bit, and nothing here times anything.

CPU, fitted on `python tools/bench_moe.py --only layer` and on a sweep of its settings over the mean rows
per expert (fp32, 2 threads): with a few dozen rows per expert, every step is bound by reading the expert
weights, and what differs is the work around the matmuls. grouped_mm, one C++ call over all segments, was
the fastest or within 5% of it at every mean below 64 rows per expert, in all measurements but two (E = 8,
k = 2, T = 197 forward: 7% behind padded; one of three runs of E = 8, k = 1, T = 197 forward), and up to
1.6x ahead of padded (E = 32, k = 1, T = 197, forward), whose bmm pays for the padding up to the largest
segment. From about a hundred rows per expert on, the loop is the fastest or within 4%: each expert's
matmul runs at the BLAS's full speed, and without autograd it runs each expert's whole FFN while the hidden
activations are in cache. So grouped_mm below a mean of 64 rows per expert (padded where grouped_mm cannot
run: float64, rows not 16-byte aligned, torch < 2.9), the loop above. The CPU behind this machine changes:
an earlier fit, on one with 30% more memory bandwidth (33.8 vs 26.1 GB/s), had found padded the fastest at
T = 197, and the rule follows the newest measurement.

CUDA: grouped_mm in bf16 on Hopper or newer (its fast kernels); padded otherwise, which keeps every step on
the device, where the loop's per-expert launches and host sync cost most.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CPU_GROUPED_BELOW = 64  # mean rows per expert below which grouped_mm beats the loop on CPU
GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what F.grouped_mm takes (not float64)


def has_grouped_mm() -> bool:
    """Whether this torch has the public grouped matmul (torch >= 2.9)."""
    return hasattr(F, "grouped_mm")


def auto_step(x: torch.Tensor, experts: int, aligned: bool) -> str:
    """The step for rows x [S, C] over `experts` local experts.

    Args:
        aligned: every weight row stride is a multiple of 16 bytes (grouped_mm's kernels need it).
    """
    grouped = aligned and has_grouped_mm() and x.dtype in GROUPED_DTYPES
    if x.is_cuda:
        hopper = torch.cuda.get_device_capability(x.device) >= (9, 0)
        return "grouped_mm" if grouped and x.dtype == torch.bfloat16 and hopper else "padded"
    if x.shape[0] < CPU_GROUPED_BELOW * experts:
        return "grouped_mm" if grouped else "padded"
    return "loop"

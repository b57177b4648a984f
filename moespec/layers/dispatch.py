"""Which expert step `Experts` runs under `dispatch="auto"`: a fixed rule per device, fitted on the benchmark.

    grouped_mm  one kernel over the jagged per-expert segments (`F.grouped_mm`, no host sync)
    padded      rows scattered into [E, max count, C] and two batched matmuls
    loop        one dense matmul per expert segment

The rule is a pure function of the device, the dtype, the widths, the experts stacked in the bank and the
rows routed to them. The same inputs always give the same step, so a run stays bit-reproducible: the steps
agree to float rounding, not bit for bit, and nothing here times anything.

CPU, fitted on `python tools/bench_moe.py --only layer` (fp32, 2 threads; the figures are in its output):
the loop runs every expert's matmul at the full speed of the BLAS once an expert gets a few hundred rows,
and adds nothing around it. With fewer rows, E small matmuls (the loop's, or grouped_mm's segments) each
pay their packing and call overhead, and one padded `bmm` pair beats them, padding included: at T = 197
tokens padded was the fastest step in 7 of 8 settings (E in {8, 32}, k in {1, 2}, forward and forward +
backward), by up to 1.7x at E = 32. So padded below a mean of 128 rows per expert, the loop above.
grouped_mm is never the CPU's pick: in this torch it was never the fastest there, and is kept to force.

CUDA: grouped_mm in bf16 on Hopper or newer (its fast kernels); padded otherwise, which keeps every step on
the device, where the loop's per-expert launches and host sync cost most.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CPU_PADDED_BELOW = 128  # mean rows per expert below which padded beats the loop on CPU
GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what F.grouped_mm takes (not float64)


def has_grouped_mm() -> bool:
    """Whether this torch has the public grouped matmul (torch >= 2.9)."""
    return hasattr(F, "grouped_mm")


def auto_step(x: torch.Tensor, experts: int, aligned: bool) -> str:
    """The step for rows x [S, C] over `experts` local experts.

    Args:
        aligned: every weight row stride is a multiple of 16 bytes (grouped_mm's kernels need it).
    """
    if x.is_cuda:
        grouped = aligned and has_grouped_mm() and x.dtype == torch.bfloat16
        hopper = torch.cuda.get_device_capability(x.device) >= (9, 0)
        return "grouped_mm" if grouped and hopper else "padded"
    return "padded" if x.shape[0] < CPU_PADDED_BELOW * experts else "loop"

"""Which expert step `Experts` runs under `dispatch="auto"`: a fixed rule per device, fitted on the benchmark.

    grouped_mm  one kernel over the jagged per-expert segments (`F.grouped_mm`, no host sync)
    padded      rows scattered into [E, max count, C] and two batched matmuls
    loop        one dense matmul per expert segment

The rule is a pure function of the device, the dtype, the widths, the experts stacked in the bank, the rows
routed to them and whether a backward will follow. The same inputs always give the same step, so a run stays
bit-reproducible: the steps agree to float rounding, not bit for bit, and nothing here times anything.

CPU, fitted on `python tools/bench_moe.py --only layer` (fp32, 2 threads; the figures are in its output):
the loop runs every expert's matmul at the full speed of the BLAS once an expert gets a few hundred rows, and
adds nothing around it; below that, E small matmuls lose to one grouped kernel. So grouped_mm while the
mean rows per expert is below the crossover, the loop above it; the crossover is lower in inference, where
grouped_mm's per-row bias gather weighs more against the matmuls than in training (whose backward is three
times the matmuls).

CUDA: grouped_mm in bf16 on Hopper or newer (its fast kernels); padded otherwise, which keeps every step on
the device, where the loop's per-expert launches and host sync cost most.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CPU_GROUPED_BELOW = {"training": 256, "inference": 160}  # mean rows per expert where the loop takes over
GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what F.grouped_mm takes (not float64)


def has_grouped_mm() -> bool:
    """Whether this torch has the public grouped matmul (torch >= 2.9)."""
    return hasattr(F, "grouped_mm")


def auto_step(x: torch.Tensor, experts: int, aligned: bool, training: bool) -> str:
    """The step for rows x [S, C] over `experts` local experts.

    Args:
        aligned: every weight row stride is a multiple of 16 bytes (grouped_mm's kernels need it).
        training: a backward will follow (grad mode on and something requires grad).
    """
    grouped = aligned and has_grouped_mm() and x.dtype in GROUPED_DTYPES
    if x.is_cuda:
        hopper = torch.cuda.get_device_capability(x.device) >= (9, 0)
        return "grouped_mm" if grouped and hopper and x.dtype == torch.bfloat16 else "padded"
    crossover = CPU_GROUPED_BELOW["training" if training else "inference"]
    if x.shape[0] >= crossover * experts:
        return "loop"
    return "grouped_mm" if grouped else "padded"

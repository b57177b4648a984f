"""Which expert step `Experts` runs under `dispatch="auto"`: a fixed rule per device, fitted on the benchmark.

    grouped_mm  one kernel over the jagged per-expert segments (`F.grouped_mm`, no host sync)
    padded      rows scattered into [E, max count, C] and two batched matmuls
    loop        one dense matmul per expert segment

The rule is a pure function of the device, the dtype, the widths, the experts stacked in the bank, the
rows routed to them and whether autograd records the forward. The same inputs always give the same step, so
a run stays bit-reproducible: the steps agree to float rounding, not bit for bit, and nothing here times
anything.

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
The crossovers move with the CPU. The figures the rule was fitted on are in docs/dispatch.md;
`tools/sweep_dispatch.py` and `tools/bench_moe.py --only layer` measure them again.

CUDA: grouped_mm in bf16 on Hopper or newer (its fast kernels); padded otherwise, which keeps every step on
the device, where the loop's per-expert launches and host sync cost most.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CPU_LOOP_FROM = 128  # mean rows per expert from which the loop is the fastest step on CPU
CPU_EQUAL_LOOP_FROM = (128, 512)  # equal segments (no padding): the loop from here, forward | autograd records
CPU_PADDED_WASTE = (1.5, 10.0, 1 / 256)  # below: padded while E x largest <= max(1, 1.5 + 10/m - m/256) x rows
GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what F.grouped_mm takes (not float64)


def traced() -> bool:
    """Whether torch.export or torch.compile is tracing this call (torch < 2.3 has no such query)."""
    return getattr(torch.compiler, "is_compiling", lambda: False)()


def exporting() -> bool:
    """Whether torch.export is tracing this call: the flag `torch.compiler.is_exporting()` reads, read directly.
    torch 2.11's Dynamo answers the call itself with True under torch.compile too, and the MoE layers took the
    export path there (every expert on every item, no routing state, so `moespec.aux_loss` returned an
    earlier step's losses); torch 2.14 answers it right."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


def has_grouped_mm() -> bool:
    """Whether this torch has the public grouped matmul (torch >= 2.9)."""
    return hasattr(F, "grouped_mm")


TRACED_GROUPED_DTYPES = (torch.bfloat16, torch.float16)  # what grouped_mm's fake (meta) kernel takes


def traced_step(dtype: torch.dtype, device: torch.device, aligned: bool) -> str:
    """The step while torch.compile traces: nothing is chosen on the sizes (no host sync). grouped_mm where its
    fake kernel takes the rows' dtype (bf16 or fp16), else padded. Autocast does not cast grouped_mm's inputs
    (seen on CPU with torch 2.14 and on an H200 with torch 2.11): under autocast the fp32 residual stream takes
    padded, whose batched matmuls autocast runs in the lower precision."""
    return "grouped_mm" if aligned and has_grouped_mm() and dtype in TRACED_GROUPED_DTYPES else "padded"


def auto_step(rows: int, dtype: torch.dtype, device: torch.device, counts: torch.Tensor, aligned: bool,
              backward: bool = False) -> str:
    """The step for `rows` rows of `dtype` on `device`, sorted by expert, `counts` [E] rows per local expert.

    Args:
        aligned: every weight row stride is a multiple of 16 bytes (grouped_mm's kernels need it).
        backward: autograd records this forward (a backward may follow).
    """
    grouped = aligned and has_grouped_mm() and dtype in GROUPED_DTYPES
    if device.type == "cuda":
        hopper = torch.cuda.get_device_capability(device) >= (9, 0)
        return "grouped_mm" if grouped and dtype == torch.bfloat16 and hopper else "padded"
    experts = counts.numel()
    if rows >= CPU_LOOP_FROM * experts:
        return "loop"
    base, few, many = CPU_PADDED_WASTE  # E * largest <= (base + few / m - many * m) * rows, m = rows / E:
    largest = int(counts.max()) if experts else 0
    if experts * largest <= max(rows, base * rows + few * experts - many * rows * rows / experts):  # even: padded
        return "padded"
    return "grouped_mm" if grouped and backward else "loop"


def equal_segments_step(rows: int, device: torch.device, backward: bool = False) -> str:
    """The step for segments of `rows` rows each (Soft MoE's slots), which need no padding: "padded" is then
    two bmm on the rows themselves, with no scatter, no gather and no waste, so it holds longer than on uneven
    segments. On CPU the loop from 128 rows per expert in a forward that autograd does not record, from 512 in
    one that it does (docs/dispatch.md); elsewhere the bmm."""
    if device.type != "cpu":
        return "padded"
    return "loop" if rows >= CPU_EQUAL_LOOP_FROM[backward] else "padded"

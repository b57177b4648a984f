"""Which expert step `Experts` runs under `dispatch="auto"`: a fixed rule per device, fitted on the benchmark.

    grouped_mm  one kernel over the jagged per-expert segments (`F.grouped_mm`, no host sync)
    padded      rows scattered into [E, max count, C] and two batched matmuls
    loop        one dense matmul per expert segment

The rule is a pure function of the device, the dtype, the widths, the experts stacked in the bank, the
rows routed to them and whether autograd records the forward. The same inputs always give the same step, so
a run stays bit-reproducible: the steps agree to float rounding, not bit for bit, and nothing here times
anything.

CPU, fitted on `python tools/bench_moe.py --only layer` and on a sweep of the bank alone over the mean rows
per expert m (4 to 788) and how unevenly they are spread (the largest segment up to 9x the mean), fp32,
2 threads, AMD EPYC (Zen 4, AVX-512), torch 2.14, forward and forward+backward timed interleaved:

- From a mean of 128 rows per expert on, the loop was the fastest in forward, even segments included
  (E = 8, m = 788: 86 ms against padded's 104 and grouped_mm's 128), and the fastest or within 8% in
  forward+backward (from m = 197 at E = 32, the fastest): each expert's matmul runs at the BLAS's full speed
  and its whole FFN runs while the hidden activations are in cache.
- Below, the matmuls are small, and a batched matmul (`bmm`, which splits the experts between the threads)
  ran a padded row up to 2x faster than grouped_mm or the loop (one small matmul after another, each split
  between the threads) ran a real one. Padded pays for every row up to the largest segment, so it wins while
  that waste is small enough, and the fewer the rows per expert, the more waste pays (the small matmuls are
  bound by reading the weights, not by arithmetic). Where padded and the best other step broke even, the
  padded batch (E x the largest segment) was above 3x the rows at a mean of m = 6 rows per expert, about 2x at
  m = 12, 1.5-1.8x at m = 25, 1.5x at m = 50 (E = 32) and 1.2-1.3x at m = 96: the bound
  1.5 + 10 / m - m / 256 (even segments at least) follows that line (E = 32, m = 6, 2x: padded 1.7x faster
  than grouped_mm in forward, 1.9x in forward+backward). Past it, the two rowwise steps: the loop in forward
  (even with grouped_mm below m = 48, 3-17% ahead from there), grouped_mm in forward+backward (2-20% ahead
  of the loop, as it writes every weight gradient with one matmul per expert). With 8 experts, whose 38 MB
  of weights the benchmark finds largely in the 32 MB L3 cache from one call to the next, the small matmuls
  did better and padded's crossover came sooner (1.2x at m = 50); in a model, other layers run between two
  calls of a layer, so the E = 32 figures (weights read from memory) are the ones fitted. On that sweep
  (`tools/sweep_dispatch.py`, 64 settings, forward and forward+backward), the step this rule picks was within
  5% of the fastest in 117 of 128 cases (60 of 64 at E = 32, all within 8%) and within 10% in 123.

The rule: the loop from a mean of 128 rows per expert; below, padded while its waste is within the bound;
past it grouped_mm when autograd records the forward, the loop when it does not (and the loop wherever
grouped_mm cannot run: float64, rows not 16-byte aligned, torch < 2.9). It depends on whether a backward may
follow, not on anything timed, so the same forward always takes the same step.
An earlier machine behind this project (less memory bandwidth, 26 vs 37 GB/s) had found grouped_mm ahead of
padded on uneven segments of a few dozen rows: the crossovers move with the CPU, and
`python tools/sweep_dispatch.py` measures them again.

Checked on a second CPU (AMD EPYC with AVX2 and no AVX-512, 19-23 GB/s, 2 threads, torch 2.14): before the
layer's segment-wise combine (`Experts.combine`), the layer benchmark found auto's pick, timed forced, the
fastest forced step in 15 of its 16 settings, and 5.6% behind grouped_mm at E = 32, k = 1, T = 6304 in
forward; since, the fastest in all 16 (the loop 25% ahead of grouped_mm in that forward), and auto itself
within 4% of the best forced step in every setting. Run again on a slower day (a 2048-cube matmul at 114
against 122 GFLOP/s): the fastest in 15 of 16 and 1.2% behind grouped_mm in the 16th (E = 8, k = 1, T = 197,
forward: padded); auto within 4% in 14, and 6-7% behind in the two where it ran the very step it was compared
with (the noise of timing the same code twice).

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


def has_grouped_mm() -> bool:
    """Whether this torch has the public grouped matmul (torch >= 2.9)."""
    return hasattr(F, "grouped_mm")


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
    segments. CPU, Soft MoE at ViT-S width, 8-32 images, interleaved: in forward the loop was 4-16% faster from
    192 rows per expert on; with autograd, bmm 7-10% faster at E = 32 with 192 and 256 rows, the loop 8-12%
    faster at E = 8 with 768 and 1024. Elsewhere the bmm."""
    if device.type != "cpu":
        return "padded"
    return "loop" if rows >= CPU_EQUAL_LOOP_FROM[backward] else "padded"

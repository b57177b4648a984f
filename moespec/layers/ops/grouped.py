"""The jagged expert matmuls of the grouped step, as torch custom ops: opaque to torch.compile, with their own
fake (shape) functions, so that a compiled MoE layer has static shapes and no graph break in any dtype.
(torch's own `_grouped_mm` has a fake kernel that takes only bf16 / fp16: torch.compile of an fp32 layer
stopped in it.) While torch.compile or torch.export traces (`traced`, from the layer's `Mode`) in bf16 / fp16,
`F.grouped_mm` goes into the graph itself instead (`aten._grouped_mm`), so that inductor tunes the GEMMs and
fuses around them.

    segment_mm(x, weight, offsets, transpose, dropped)  y[r] = x[r] @ weight[e].T (or weight[e]), r in e's rows
    segment_outer(a, b, offsets)                       [E, M, N]: sum over e's rows of a[r]^T b[r]
    segment_sum(rows, offsets)                         [E, N]: sum over e's rows of rows[r]

Rows are sorted by expert; expert e owns rows [offsets[e-1], offsets[e]) (offsets int32 [E], on the device:
no host sync). With `dropped`, rows past offsets[-1] (pairs a capacity dropped, `steps.rows.Segments`) give 0.

Each op runs `F.grouped_mm` where this torch has it for the dtype and the strides are 16-byte aligned (on CUDA
the fast kernels are bf16 on Hopper or newer), else one matmul per segment, which reads the offsets on the
host. (Eager on CPU, `ExpertLinear` computes the weight gradient with one matmul per expert into memory kept
between backwards instead, `gradient_memory`.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from .custom import custom_op

GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what F.grouped_mm computes in (not float64)
VISIBLE_DTYPES = (torch.bfloat16, torch.float16)  # traced as `aten._grouped_mm` itself (`_inductor_sees`)


def has_grouped_mm() -> bool:
    """Whether this torch has the public grouped matmul (torch >= 2.9)."""
    return hasattr(F, "grouped_mm")


def _grouped(like: torch.Tensor, *widths: int) -> bool:
    """Whether F.grouped_mm takes operands of `like`'s dtype with these row strides (`widths`, in elements): its
    dtypes, and every row stride a multiple of 16 bytes."""
    if not has_grouped_mm() or like.dtype not in GROUPED_DTYPES:
        return False
    return all(width * like.element_size() % 16 == 0 for width in widths)


def segment_slices(offsets: torch.Tensor):
    """(expert, row slice) of every expert segment (reads the offsets on the host)."""
    start = 0
    for e, end in enumerate(offsets.tolist()):
        yield e, slice(start, end)
        start = end


def _zero_dropped(y: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """y with its rows past offsets[-1] set to 0 (the grouped kernels leave them unwritten)."""
    rows = torch.arange(y.shape[0], device=y.device)
    return y.masked_fill_((rows >= offsets[-1:]).unsqueeze(-1), 0) if offsets.numel() else y.zero_()


def _segment_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, transpose: bool,
                dropped: bool) -> torch.Tensor:
    w = weight.transpose(1, 2) if transpose else weight  # [E, K, N]
    if _grouped(x, *w.shape[1:]):
        y = F.grouped_mm(x, w, offs=offsets)
        return _zero_dropped(y, offsets) if dropped else y
    y = (x.new_zeros if dropped else x.new_empty)(x.shape[0], w.shape[-1])
    for e, rows in segment_slices(offsets):
        torch.mm(x[rows], w[e], out=y[rows])
    return y


def _segment_outer(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if _grouped(a, a.stride(0), b.stride(0)):
        return F.grouped_mm(a.t(), b, offs=offsets)
    out = a.new_empty(offsets.shape[0], a.shape[1], b.shape[1])
    for e, rows in segment_slices(offsets):
        torch.mm(a[rows].t(), b[rows], out=out[e])  # no rows: zeros
    return out


def _segment_mm_shape(x, weight, offsets, transpose, dropped):
    return x.new_empty(x.shape[0], weight.shape[1] if transpose else weight.shape[2])


def _segment_outer_shape(a, b, offsets):
    return a.new_empty(offsets.shape[0], a.shape[1], b.shape[1])


_segment_mm = custom_op("segment_mm", _segment_mm, fake=_segment_mm_shape)
_segment_outer = custom_op("segment_outer", _segment_outer, fake=_segment_outer_shape)


@register_flop_formula(torch.ops.moespec.segment_mm, get_raw=True)
def _segment_mm_flops(x, weight, offsets, transpose, dropped, *_, **__) -> int:
    """torch's FlopCounterMode sees the grouped step's experts (as fvcore does through `fvcore_handles`): 2 per
    multiply-add of the rows the segments hold (a dropped row past offsets[-1] is not multiplied)."""
    rows = int(offsets[-1]) if dropped and offsets.numel() and offsets.device.type != "meta" else x.shape[0]
    return 2 * rows * weight.shape[1] * weight.shape[2]


@register_flop_formula(torch.ops.moespec.segment_outer, get_raw=True)
def _segment_outer_flops(a, b, offsets, *_, **__) -> int:
    """The weight gradients' grouped outer products: every row once."""
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


def segment_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *, transpose: bool = True,
               dropped: bool = False, traced: bool = False) -> torch.Tensor:
    """[S, N]: row r of x [S, K] times weight[e].T (weight [E, N, K]; `transpose=False`: weight[e], weight
    [E, K, N]), e the expert whose segment holds r. With `dropped`, rows past offsets[-1] give 0. `traced`:
    torch.compile or torch.export traces the call (`Mode.traced`)."""
    w = weight.transpose(1, 2) if transpose else weight
    if traced and _inductor_sees(x, *w.shape[1:]):
        y = F.grouped_mm(x, w, offs=offsets)
        return _zero_dropped(y, offsets) if dropped else y
    return _segment_mm(x, weight, offsets, transpose, dropped)


def segment_outer(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *, traced: bool = False) -> torch.Tensor:
    """[E, M, N]: sum over the rows r of expert e of a[r]^T b[r] (a [S, M], b [S, N]); 0 for an expert without
    rows; rows past offsets[-1] take no part."""
    if traced and _inductor_sees(a, a.stride(0), b.stride(0)):
        return F.grouped_mm(a.t(), b, offs=offsets)
    return _segment_outer(a, b, offsets)


def _inductor_sees(like: torch.Tensor, *widths: int) -> bool:
    """Whether, while torch.compile or torch.export traces, the grouped matmul goes into the graph as
    `aten._grouped_mm` itself, not as the opaque custom op: in bf16 / fp16 (the dtypes whose `_grouped_mm` has a
    fake kernel and a tuned inductor lowering), with 16-byte aligned strides. Inductor can then choose the
    GEMM's kernel and fuse around it."""
    return like.dtype in VISIBLE_DTYPES and _grouped(like, *widths)


def segment_sum(rows: torch.Tensor, offsets: torch.Tensor, *, traced: bool = False) -> torch.Tensor:
    """[E, N]: the sum of each expert's rows of `rows` [S, N], as a grouped matmul of a row of ones by the rows:
    [E, 1, N], so that the sums come out contiguous, in the layout of a bias (its gradient is not copied again).
    The ones' row stride is 16 bytes, what the grouped kernels need. While torch.compile traces, the rows by a
    block of ones (inductor lays out a slice of ones afresh, and the 16 bytes are lost); inductor fuses the copy."""
    ones = rows.new_ones(rows.shape[0], max(1, 16 // rows.element_size()))
    if traced:
        return segment_outer(rows, ones, offsets, traced=True)[..., 0]
    return segment_outer(ones[:, :1], rows, offsets)[:, 0]

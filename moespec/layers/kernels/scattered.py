"""The Triton kernels of the scattered expert FFN (`ops/scattered.py` says what each computes) and their
launchers: tile configs, grids and output buffers.

    launch_forward        fc1 (rows gathered in the loads, bias and activation in the epilogue), then fc2 (bias and
                          gate in the epilogue, rows scattered in the stores): (y, pre, h)
    launch_backward_rows  fc2's backward (activation backward in the epilogue), then fc1's: (d pre, d gates, d slots)
    launch_outer          each expert's weight (and bias) gradient from its rows, rows gathered in the loads

Each kernel's tile config is in `CONFIGS`, chosen from what tools/tune_fused.py measured on an H200 among the
configs that do not spill (tools/kernel_report.py); docs/gpu.md has the figures. Under `TRITON_INTERPRET=1`
(the CPU, for tests) the blocks are the smallest `tl.dot` takes, so that small tests cross several row and
column blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRETED, _act, _act_grad, _dot, _tile_of


@triton.jit
def _fc1_kernel(x_ptr, order_ptr, w_ptr, b_ptr, offsets_ptr, pre_ptr, h_ptr,
                rows, experts, top_k, in_features, hidden,
                stride_x, stride_we, stride_wn, stride_be, stride_pre, stride_h, row_blocks,
                GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE_PRE: tl.constexpr, ACT: tl.constexpr,
                GLU: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """pre = x[order // k] @ w[e].T + b[e] (saved if SAVE_PRE), h = act(pre) (GLU: of both halves of w's rows,
    a = rows [0, H), b = rows [H, 2H)). The tail's rows are not written: nothing reads them."""
    expert, row, row_mask, col, col_mask, _ = _tile_of(tl.program_id(0), row_blocks, offsets_ptr, experts, rows,
                                                       hidden, BLOCK_M, BLOCK_N, GROUP_M)
    if (expert < 0) | (expert == experts):
        return
    source = row
    if GATHER:
        source = tl.load(order_ptr + row, mask=row_mask, other=0) // top_k
    x_rows = x_ptr + source.to(tl.int64)[:, None] * stride_x
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + col[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        x = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        x = x.to(w_ptr.dtype.element_ty)
        w_mask = k_mask[:, None] & col_mask[None, :]
        acc = _dot(x, tl.load(w_cols + k[:, None], mask=w_mask, other=0.0), acc, PRECISION)
        if GLU != 0:
            w_b = tl.load(w_cols + hidden * stride_wn + k[:, None], mask=w_mask, other=0.0)
            acc_b = _dot(x, w_b, acc_b, PRECISION)
    if HAS_BIAS:
        bias = b_ptr + expert * stride_be + col
        acc += tl.load(bias, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if GLU != 0:
            acc_b += tl.load(bias + hidden, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    pre = pre_ptr + row.to(tl.int64)[:, None] * stride_pre + col[None, :]
    a = acc.to(h_ptr.dtype.element_ty)  # the activation reads what backward will read
    if SAVE_PRE:
        tl.store(pre, a, mask=mask)
    a = a.to(tl.float32)
    if GLU == 0:
        h = _act(a, ACT)
    else:
        b = acc_b.to(h_ptr.dtype.element_ty)
        if SAVE_PRE:
            tl.store(pre + hidden, b, mask=mask)
        b = b.to(tl.float32)
        if GLU == 1:
            h = _act(a, ACT) * b
        else:
            h = a * _act(b, ACT)
    tl.store(h_ptr + row.to(tl.int64)[:, None] * stride_h + col[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)

@triton.jit
def _rows_kernel(a_ptr, w_ptr, b_ptr, gate_ptr, order_ptr, offsets_ptr, out_ptr,
                 rows, experts, in_features, out_features,
                 stride_a, stride_we, stride_wn, stride_wk, stride_be, stride_out, row_blocks,
                 SCATTER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GATE: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out[order[r]] = gate[r] * (a[r] @ w[e] + b[e]), w[e][k, n] at stride_wk, stride_wn (fc2: w2[e].T; the
    rows' gradient of fc1: w1[e]). The tail's rows get 0."""
    expert, row, row_mask, col, col_mask, _ = _tile_of(tl.program_id(0), row_blocks, offsets_ptr, experts, rows,
                                                       out_features, BLOCK_M, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    mask = row_mask[:, None] & col_mask[None, :]
    target = row
    if SCATTER:
        target = tl.load(order_ptr + row, mask=row_mask, other=0)
    out = out_ptr + target.to(tl.int64)[:, None] * stride_out + col[None, :]
    if expert == experts:
        tl.store(out, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=mask)
        return
    a_rows = a_ptr + row.to(tl.int64)[:, None] * stride_a
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + col[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None] * stride_wk, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = _dot(a.to(w_ptr.dtype.element_ty), w, acc, PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + col, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_GATE:
        acc *= tl.load(gate_ptr + row, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)

@triton.jit
def _fc2_backward_kernel(dy_ptr, order_ptr, w_ptr, gate_ptr, pre_ptr, offsets_ptr, dpre_ptr, dgate_ptr,
                         rows, experts, top_k, out_features, hidden,
                         stride_dy, stride_we, stride_wk, stride_pre, stride_dpre, stride_dgate, row_blocks,
                         GATHER: tl.constexpr, HAS_GATE: tl.constexpr, ACT: tl.constexpr, GLU: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """g = dy[order // k] @ w2[e] (w2[e][k, n] at stride_wk, 1); this column block's share of each row's gate
    gradient, g . h, into dgate[r, column block] (the output bias's share, dy . b2[e], is added outside);
    dpre = act'(pre) * gate * g. The tail's rows get dpre = 0 and a gate gradient of 0."""
    expert, row, row_mask, col, col_mask, column_block = _tile_of(tl.program_id(0), row_blocks, offsets_ptr,
                                                                  experts, rows, hidden, BLOCK_M, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    mask = row_mask[:, None] & col_mask[None, :]
    dpre = dpre_ptr + row.to(tl.int64)[:, None] * stride_dpre + col[None, :]
    if expert == experts:  # the tail: zeros, so that a reduction over every row may read them
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=dpre_ptr.dtype.element_ty)
        tl.store(dpre, zeros, mask=mask)
        if GLU != 0:
            tl.store(dpre + hidden, zeros, mask=mask)
        if HAS_GATE:
            tl.store(dgate_ptr + row * stride_dgate + column_block, tl.zeros((BLOCK_M,), tl.float32), mask=row_mask)
        return
    source = row
    if GATHER:
        source = tl.load(order_ptr + row, mask=row_mask, other=0) // top_k
    dy_rows = dy_ptr + source.to(tl.int64)[:, None] * stride_dy
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + col[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, out_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < out_features
        dy = tl.load(dy_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None] * stride_wk, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = _dot(dy.to(w_ptr.dtype.element_ty), w, acc, PRECISION)
    pre = pre_ptr + row.to(tl.int64)[:, None] * stride_pre + col[None, :]
    a = tl.load(pre, mask=mask, other=0.0).to(tl.float32)
    b = a
    if GLU != 0:
        b = tl.load(pre + hidden, mask=mask, other=0.0).to(tl.float32)
    if HAS_GATE:
        if GLU == 0:
            h = _act(a, ACT)
        elif GLU == 1:
            h = _act(a, ACT) * b
        else:
            h = a * _act(b, ACT)
        tl.store(dgate_ptr + row * stride_dgate + column_block, tl.sum(acc * h, axis=1), mask=row_mask)
        acc *= tl.load(gate_ptr + row, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    if GLU == 0:
        tl.store(dpre, (acc * _act_grad(a, ACT)).to(dpre_ptr.dtype.element_ty), mask=mask)
    elif GLU == 1:  # h = act(a) * b
        tl.store(dpre, (acc * b * _act_grad(a, ACT)).to(dpre_ptr.dtype.element_ty), mask=mask)
        tl.store(dpre + hidden, (acc * _act(a, ACT)).to(dpre_ptr.dtype.element_ty), mask=mask)
    else:  # h = a * act(b)
        tl.store(dpre, (acc * _act(b, ACT)).to(dpre_ptr.dtype.element_ty), mask=mask)
        tl.store(dpre + hidden, (acc * a * _act_grad(b, ACT)).to(dpre_ptr.dtype.element_ty), mask=mask)

@triton.jit
def _outer_kernel(a_ptr, a_order_ptr, gate_ptr, b_ptr, b_order_ptr, offsets_ptr, out_ptr, bias_ptr,
                  a_div, b_div, m_size, n_size, stride_a, stride_b, stride_oe, stride_om, stride_bias,
                  A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, SCALE_A: tl.constexpr,
                  BIAS_GRAD: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[e][m, n] = sum over e's rows r of gate[r] a[i(r), m] b[j(r), n], i(r) = a_order[r] // a_div (or r),
    j likewise; bias[e][m] = sum of the same rows of gate * a. One program per (expert, output tile), its
    loop over the expert's rows BLOCK_K at a time: 0 for an expert without rows."""
    expert = tl.program_id(0)
    n_tiles = tl.cdiv(n_size, BLOCK_N)
    tile_m, tile_n = tl.program_id(1) // n_tiles, tl.program_id(1) % n_tiles
    start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0)
    end = tl.load(offsets_ptr + expert)
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = m < m_size, n < n_size
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    column_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        r = r0 + tl.arange(0, BLOCK_K)
        r_mask = r < end
        i = r
        if A_GATHER:
            i = tl.load(a_order_ptr + r, mask=r_mask, other=0) // a_div
        j = r
        if B_GATHER:
            j = tl.load(b_order_ptr + r, mask=r_mask, other=0) // b_div
        a = tl.load(a_ptr + i.to(tl.int64)[:, None] * stride_a + m[None, :], mask=r_mask[:, None] & m_mask[None, :],
                    other=0.0).to(tl.float32)
        if SCALE_A:
            a *= tl.load(gate_ptr + r, mask=r_mask, other=0.0).to(tl.float32)[:, None]
        if BIAS_GRAD:
            column_sum += tl.sum(a, axis=0)
        b = tl.load(b_ptr + j.to(tl.int64)[:, None] * stride_b + n[None, :], mask=r_mask[:, None] & n_mask[None, :],
                    other=0.0)
        acc = _dot(tl.trans(a.to(out_ptr.dtype.element_ty)), b.to(out_ptr.dtype.element_ty), acc, PRECISION)
    out = out_ptr + expert.to(tl.int64) * stride_oe + m[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
    if BIAS_GRAD:
        if tile_n == 0:
            tl.store(bias_ptr + expert * stride_bias + m, column_sum.to(bias_ptr.dtype.element_ty), mask=m_mask)

# Tile shapes and launch options per kernel, for 16-bit weights on a Hopper GPU (fp32 takes BLOCK_K <= 32): of
# the candidates tools/tune_fused.py timed on an H200 (docs/gpu.md), the fastest that neither spills registers
# (tools/kernel_report.py) nor needs more shared memory than sm_90 has, GLU experts included. GROUP_M row blocks
# sweep the column blocks together (the grouped raster), so that their rows, gathered or not, come from memory
# once and then from L2.
CONFIGS: dict[str, dict[str, int]] = {
    "fc1": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    "fc2": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    "fc2_backward": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    "fc1_backward": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    "outer": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 8, "num_stages": 3},
}
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2}  # several row and column blocks


def _config(kernel: str, dtype: torch.dtype) -> dict[str, int]:
    """`kernel`'s tile sizes and launch options for weights of `dtype` (the smallest under the interpreter)."""
    if INTERPRETED:
        return dict(INTERPRETER_CONFIG)
    config = dict(CONFIGS[kernel])
    if dtype == torch.float32:
        config["BLOCK_K"] = min(config["BLOCK_K"], 32)
    return config


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: fp32 as IEEE unless torch allows TF32 for CUDA matmuls (ignored for 16 bits)."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _row_blocks(rows: int, experts: int, block_m: int) -> int:
    """A static bound on the row blocks of E segments and the tail: each rounds up at most once."""
    return triton.cdiv(rows, block_m) + experts + 1


def _row_launch(kernel, name: str, dtype: torch.dtype, rows: int, experts: int, columns: int, *args,
                **flags) -> dict[str, int]:
    """Launch row kernel `kernel` over every (row block, column block) tile of `rows` sorted rows and `columns`
    output columns, in one dimension (`_tile` rasters it). Returns the config it ran with."""
    config = _config(name, dtype)
    row_blocks = _row_blocks(rows, experts, config["BLOCK_M"])
    grid = (row_blocks * triton.cdiv(columns, config["BLOCK_N"]),)
    _launch(kernel, grid, *args, row_blocks, PRECISION=_precision(dtype), **flags, **config)
    return config


def launch_forward(items: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
                   w2: torch.Tensor, b2: torch.Tensor | None, gates: torch.Tensor | None, order: torch.Tensor | None,
                   top_k: int, act: int, glu: int, save: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [T, C'], pre [P, H'] (empty unless `save`), h [P, H]): the forward of `ops.scattered.scattered_experts`."""
    rows = items.shape[0] if order is None else order.shape[0]
    experts, wide, in_features = w1.shape
    out_features, hidden = w2.shape[1:]
    dtype = w1.dtype
    out_dtype = dtype if gates is None else torch.promote_types(dtype, gates.dtype)
    pre = items.new_empty((rows, wide) if save else (0, wide), dtype=dtype)
    h = items.new_empty(rows, hidden, dtype=dtype)
    z = items.new_empty(rows, out_features, dtype=out_dtype)
    if rows:
        _row_launch(_fc1_kernel, "fc1", dtype, rows, experts, hidden,
                    items, order, w1, b1, offsets, pre, h, rows, experts, top_k, in_features, hidden,
                    items.stride(0), w1.stride(0), w1.stride(1), _stride(b1), pre.stride(0), h.stride(0),
                    GATHER=order is not None, HAS_BIAS=b1 is not None, SAVE_PRE=save, ACT=act, GLU=glu)
        _row_launch(_rows_kernel, "fc2", dtype, rows, experts, out_features,
                    h, w2, b2, gates, order, offsets, z, rows, experts, hidden, out_features,
                    h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), _stride(b2), z.stride(0),
                    SCATTER=order is not None, HAS_BIAS=b2 is not None, HAS_GATE=gates is not None)
    y = z if top_k == 1 else z.view(-1, top_k, out_features).sum(1)
    return y, pre, h


def launch_backward_rows(grad: torch.Tensor, items: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor,
                         w2: torch.Tensor, gates: torch.Tensor | None, order: torch.Tensor | None, pre: torch.Tensor,
                         top_k: int, act: int, glu: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d pre [P, H'], d gates [P, column blocks] fp32 partial dot products (empty without gates), d slots [P, C]):
    fc2's backward, then fc1's, of P > 0 sorted rows."""
    rows, wide = pre.shape
    experts, _, in_features = w1.shape
    out_features, hidden = w2.shape[1:]
    dtype = w1.dtype
    hidden_blocks = triton.cdiv(hidden, _config("fc2_backward", dtype)["BLOCK_N"])
    d_pre = pre.new_empty(rows, wide)
    d_gates = grad.new_empty((rows, hidden_blocks) if gates is not None else (0, hidden_blocks), dtype=torch.float32)
    d_slots = items.new_empty(rows, in_features)
    _row_launch(_fc2_backward_kernel, "fc2_backward", dtype, rows, experts, hidden,
                grad, order, w2, gates, pre, offsets, d_pre, d_gates, rows, experts, top_k, out_features, hidden,
                grad.stride(0), w2.stride(0), w2.stride(1), pre.stride(0), d_pre.stride(0), d_gates.stride(0),
                GATHER=order is not None, HAS_GATE=gates is not None, ACT=act, GLU=glu)
    _row_launch(_rows_kernel, "fc1_backward", dtype, rows, experts, in_features,
                d_pre, w1, None, None, order, offsets, d_slots, rows, experts, wide, in_features,
                d_pre.stride(0), w1.stride(0), w1.stride(2), w1.stride(1), 0, d_slots.stride(0),
                SCATTER=order is not None, HAS_BIAS=False, HAS_GATE=False)
    return d_pre, d_gates, d_slots


def launch_outer(a: torch.Tensor, a_order: torch.Tensor | None, a_div: int, gates: torch.Tensor | None,
                 b: torch.Tensor, b_order: torch.Tensor | None, b_div: int, offsets: torch.Tensor, out: torch.Tensor,
                 bias_out: torch.Tensor | None) -> None:
    """out[e] = sum over e's rows r of (gate[r] a[order[r] // div])^T b[...] (each row index by its own order and
    divisor, or r); bias_out[e] = the sum of those rows of a."""
    experts, m, n = out.shape
    config = _config("outer", out.dtype)
    config.pop("GROUP_M")
    tiles = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
    _launch(_outer_kernel, (experts, tiles),
            a, a_order, gates, b, b_order, offsets, out, bias_out, a_div, b_div, m, n,
            a.stride(0), b.stride(0), out.stride(0), out.stride(1), _stride(bias_out),
            A_GATHER=a_order is not None, B_GATHER=b_order is not None, SCALE_A=gates is not None,
            BIAS_GRAD=bias_out is not None, PRECISION=_precision(out.dtype), **config)


def _stride(t: torch.Tensor | None) -> int:
    return t.stride(0) if t is not None else 0


def _launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    """kernel[grid](*args) with None pointers (absent bias, gate, order) as the int 0: the kernels never read
    them, under constexpr flags."""
    kernel[grid](*[0 if a is None else a for a in args], **meta)

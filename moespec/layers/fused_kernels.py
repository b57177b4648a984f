"""The Triton kernels of the fused expert step (`fused.py` launches them; its docstring says what each computes).
Defined only where Triton is installed; under `TRITON_INTERPRET=1` (read by Triton when they are defined) they
run in its interpreter on CPU.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

@triton.jit
def _segment_of_block(block, offsets_ptr, experts, rows, BLOCK_M: tl.constexpr):
    """(segment, first row, end row) of row block `block`: blocks of BLOCK_M rows tile each expert's segment
    in turn, then the tail [offsets[E - 1], rows) as segment E; past them, segment -1 (nothing to do)."""
    segment = -1
    first = 0
    end = 0
    blocks_before = 0
    start = 0
    for e in range(0, experts + 1):
        stop = tl.load(offsets_ptr + tl.minimum(e, experts - 1))
        stop = tl.where(e < experts, stop, rows)
        blocks = tl.cdiv(stop - start, BLOCK_M)
        hit = (block >= blocks_before) & (block < blocks_before + blocks)
        segment = tl.where(hit, e, segment)
        first = tl.where(hit, start + (block - blocks_before) * BLOCK_M, first)
        end = tl.where(hit, stop, end)
        blocks_before += blocks
        start = stop
    return segment, first, end

_UPCAST_DOT = tl.constexpr(INTERPRETED)

@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b, accumulated in fp32. Triton's interpreter multiplies 16-bit floats wrongly (3.8: by their
    bits), so there the operands go in as fp32: the same products, as one of two 16-bit floats is exact in
    fp32."""
    if _UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)

@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 0:  # GELU, exact: x * Phi(x)
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:  # SiLU
        return x * tl.sigmoid(x)

@triton.jit
def _act_grad(x, ACT: tl.constexpr):
    if ACT == 0:  # Phi(x) + x * phi(x)
        return 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    else:  # s + x s (1 - s)
        s = tl.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))

@triton.jit
def _tile(pid, row_blocks, columns, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program `pid` in the grouped raster: GROUP_M consecutive row blocks sweep
    the column blocks together, so that their rows (gathered or not) are read from memory once and then
    from L2 for every column block, and each column block's weights are read once per group."""
    column_blocks = tl.cdiv(columns, BLOCK_N)
    in_group = GROUP_M * column_blocks
    first = (pid // in_group) * GROUP_M
    size = tl.minimum(row_blocks - first, GROUP_M)
    return first + (pid % in_group) % size, (pid % in_group) // size

@triton.jit
def _tile_of(pid, row_blocks, offsets_ptr, experts, rows, columns, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             GROUP_M: tl.constexpr):
    """(expert, its rows [BLOCK_M], their mask, the columns [BLOCK_N], their mask, the column block) of program
    `pid` of a row kernel: `_tile`'s raster, then `_segment_of_block`'s expert and rows (expert < 0: none)."""
    block, column_block = _tile(pid, row_blocks, columns, BLOCK_N, GROUP_M)
    expert, first, end = _segment_of_block(block, offsets_ptr, experts, rows, BLOCK_M)
    row = first + tl.arange(0, BLOCK_M)
    col = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, row, row < end, col, col < columns, column_block


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

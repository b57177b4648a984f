"""The Triton helpers every kernel family shares: the activations and their derivatives, the fp32-accumulating dot,
and the row-block raster over experts' segments (`_segment_of_block`, `_tile`, `_tile_of`).

`INTERPRETED`: Triton's interpreter runs the kernels on CPU (TRITON_INTERPRET=1, read when they are defined).
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

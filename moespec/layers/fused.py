"""The "triton" expert step: the experts' FFN (fc1 -> act -> fc2) over routed pairs in Triton kernels that
gather their input rows and scatter their output rows themselves, after ScatterMoE (Tan et al. 2024, "Scattered
Mixture-of-Experts Implementation", github.com/shawntan/scattermoe, Apache-2.0): the pairs are sorted by expert
as indices, never as activations, and no padded or permuted copy of the rows is written.

With P = T * k sorted pairs, `order` [P] the slot t * k + j of each sorted row (None: the rows are the items,
k = 1) and e the expert whose segment holds row r (rows past offsets[-1] are the tail of pairs a capacity
dropped: they give 0, and no gradient):

    _fc1_kernel           pre[r] = items[order[r] // k] @ w1[e].T + b1[e]       rows gathered in the loads
                          h[r] = act(pre[r])  (GLU: act(a) * b or a * act(b))   bias and activation in the epilogue
    _rows_kernel          z[order[r]] = gate[r] * (h[r] @ w2[e].T + b2[e])      bias and gate in the epilogue,
                                                                                rows scattered in the stores
                          y = z.view(T, k, C').sum(1)
  backward:
    _fc2_backward_kernel  g = dy[order[r] // k] @ w2[e]
                          dgate[r] = g . h[r] + dy[order[r] // k] . b2[e]
                          dpre[r] = act'(pre[r]) * gate[r] * g                  activation backward in the epilogue
    _rows_kernel          dz[order[r]] = dpre[r] @ w1[e];  d items = dz.view(T, k, C).sum(1)
    _outer_kernel         dw2[e] = sum_r (gate dy)^T h,  db2[e] = sum_r gate dy;  dw1[e] = sum_r dpre^T x,  db1[e]

No host sync: each row-block program finds its expert and rows from the int32 segment ends on the device
(`_segment_of_block`), over a static grid of ceil(P / BLOCK_M) + E + 1 row blocks (E segments and the tail,
each rounding up once); the blocks past the segments return at once. Every launch's grid depends only on the
shapes.

Experts: plain (GELU with erf, as timm's nn.GELU, or SiLU) or gated (GLU either order, e.g. SwiGLU), fc1 / fc2
biases optional; no inner norm, no dropout. Matmuls run in the weights' dtype (fp32, bf16, fp16; the items are
cast in the loads) with fp32 accumulation (`tl.dot`; fp32 as IEEE unless torch allows TF32 for CUDA matmuls).

The block sizes below (`_blocks`) are GPU-sensible defaults, untuned: no GPU has run these kernels yet. Under
`TRITON_INTERPRET=1` (the CPU, for tests) the blocks are the smallest `tl.dot` takes, so that small tests cross
several row and column blocks.

The two ops (`moespec::fused_ffn`, `moespec::fused_ffn_backward`) are `torch.library.custom_op`s with fake
functions: torch.compile traces them whole and runs them as they are. (`torch.library.triton_op` would let
Inductor see the kernels, but its fake call of an interpreted kernel fails under torch.compile, so the CPU
tests could not check it.)

Triton is optional: without it this module imports, and `unavailable` says why the step cannot run.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the step reports itself unavailable
    triton = tl = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read by triton when the kernels below are defined
ACTIVATIONS = ("gelu", "silu")  # GELU with erf (timm's nn.GELU, F.gelu's default), x * sigmoid(x)
GLU_ORDERS = (None, "act_first", "act_last")  # plain, act(a) * b (SwiGLU), a * act(b)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernels cannot run on `device` in `dtype`, or None where they can."""
    if triton is None:
        return "triton is not installed"
    if dtype not in DTYPES:
        return f"the kernels compute in {', '.join(str(d) for d in DTYPES)}, not {dtype}"
    if device.type == "cpu" and not INTERPRETED:
        return "on CPU Triton kernels run only in its interpreter: set TRITON_INTERPRET=1 before importing moespec"
    if device.type not in ("cpu", "cuda"):
        return f"no Triton kernels for {device.type} here"
    return None


def activation(act) -> str | None:
    """The kernels' name for the activation module `act` ("gelu", "silu"), or None if they have none for it."""
    if isinstance(act, torch.nn.GELU):
        return "gelu" if act.approximate == "none" else None
    if isinstance(act, torch.nn.SiLU):
        return "silu"
    if type(act).__module__.startswith("timm."):  # timm's own modules: F.gelu, x * sigmoid(x)
        return {"GELU": "gelu", "Swish": "silu"}.get(type(act).__name__)
    return None


def fused_experts(items: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
                  w2: torch.Tensor, b2: torch.Tensor | None, *, act: str, glu: str | None,
                  order: torch.Tensor | None = None, top_k: int = 1, gates: torch.Tensor | None = None,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """y[t] = sum over the k pairs (t, j) of gates * expert(items[t]), the experts' FFN in the fused kernels.

    Args:
        items: [T, C] the items (any float dtype: cast in the kernels' loads).
        offsets: int32 [E] end of each expert's segment among the P sorted rows; rows past offsets[-1] give 0.
        w1, b1: [E, H', C], [E, H'] fc1 (H' = 2H for a GLU); w2, b2: [E, C', H], [E, C'] fc2; biases optional.
        act: "gelu" or "silu"; glu: None, "act_first" or "act_last" (`experts.GluOrder`).
        order: [P] slot t * k + j of each sorted row (`routing.inverse_permutation(position)`); None: row r is
            item r (P = T, k = 1).
        gates: [P] gate of each sorted row, or None (1).
        dtype: the matmuls' dtype (autocast's); the weights are cast to it here. None: w1's.
    Returns:
        [T, C'] in the promoted dtype of the matmuls and the gates.
    """
    dtype = dtype or w1.dtype
    w1, w2 = w1.to(dtype).contiguous(), w2.to(dtype).contiguous()  # the kernels read rows of unit stride
    b1, b2 = [None if b is None else b.to(dtype).contiguous() for b in (b1, b2)]
    gates, order = [None if t is None else t.contiguous() for t in (gates, order)]
    return FusedExperts.apply(items.contiguous(), offsets, w1, b1, w2, b2, gates, order, top_k,
                              ACTIVATIONS.index(act), GLU_ORDERS.index(glu))


class FusedExperts(torch.autograd.Function):
    """The fused step under autograd: forward saves fc1's pre-activations (not the gathered rows, nor any
    output), backward runs the three backward kernels (`fused_ffn_backward`). Both are custom ops, so that
    torch.compile traces the step without a graph break."""

    @staticmethod
    def forward(ctx, items, offsets, w1, b1, w2, b2, gates, order, top_k, act, glu):
        save = any(ctx.needs_input_grad)  # grad mode is off in here
        y, pre, h = fused_ffn(items, offsets, w1, b1, w2, b2, gates, order, top_k, act, glu, save)
        ctx.save_for_backward(items, offsets, w1, b1, w2, b2, gates, order, pre, h)
        ctx.top_k, ctx.act, ctx.glu = top_k, act, glu
        return y

    @staticmethod
    def backward(ctx, grad):
        items, offsets, w1, b1, w2, b2, gates, order, pre, h = ctx.saved_tensors
        grads = fused_ffn_backward(grad.contiguous(), items, offsets, w1, b1, w2, b2, gates, order, pre, h,
                                   ctx.top_k, ctx.act, ctx.glu)
        d_items, d_w1, d_b1, d_w2, d_b2, d_gates = [g if need else None for g, need in
                                                    zip(grads, [ctx.needs_input_grad[i] for i in (0, 2, 3, 4, 5, 6)],
                                                        strict=True)]
        return d_items, None, d_w1, d_b1, d_w2, d_b2, d_gates, None, None, None, None


def _blocks(dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes and launch options (untuned GPU defaults; the smallest under the interpreter)."""
    if INTERPRETED:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32 if dtype == torch.float32 else 64, "num_warps": 8,
            "num_stages": 3}


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: fp32 as IEEE unless torch allows TF32 for CUDA matmuls (ignored for 16 bits)."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _row_blocks(rows: int, experts: int, block_m: int) -> int:
    """A static bound on the row blocks of E segments and the tail: each rounds up at most once."""
    return triton.cdiv(rows, block_m) + experts + 1


def _fused_ffn(items: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
               w2: torch.Tensor, b2: torch.Tensor | None, gates: torch.Tensor | None, order: torch.Tensor | None,
               top_k: int, act: int, glu: int, save: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [T, C'], pre [P, H'] (empty unless `save`), h [P, H]): the forward of `fused_experts`."""
    rows = items.shape[0] if order is None else order.shape[0]
    experts, wide, in_features = w1.shape
    out_features, hidden = w2.shape[1:]
    dtype = w1.dtype
    out_dtype = dtype if gates is None else torch.promote_types(dtype, gates.dtype)
    pre = items.new_empty((rows, wide) if save else (0, wide), dtype=dtype)
    h = items.new_empty(rows, hidden, dtype=dtype)
    z = items.new_empty(rows, out_features, dtype=out_dtype)
    if rows:
        blocks = _blocks(dtype)
        row_blocks = _row_blocks(rows, experts, blocks["BLOCK_M"])
        _launch(_fc1_kernel, (row_blocks, triton.cdiv(hidden, blocks["BLOCK_N"])),
                items, order, w1, b1, offsets, pre, h, rows, experts, top_k, in_features, hidden,
                items.stride(0), w1.stride(0), w1.stride(1), _stride(b1), pre.stride(0), h.stride(0),
                GATHER=order is not None, HAS_BIAS=b1 is not None, SAVE_PRE=save, ACT=act, GLU=glu,
                PRECISION=_precision(dtype), **blocks)
        _launch(_rows_kernel, (row_blocks, triton.cdiv(out_features, blocks["BLOCK_N"])),
                h, w2, b2, gates, order, offsets, z, rows, experts, hidden, out_features,
                h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), _stride(b2), z.stride(0),
                SCATTER=order is not None, HAS_BIAS=b2 is not None, HAS_GATE=gates is not None,
                PRECISION=_precision(dtype), **blocks)
    y = z if top_k == 1 else z.view(-1, top_k, out_features).sum(1)
    return y, pre, h


def _fused_ffn_backward(grad: torch.Tensor, items: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor,
                        b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
                        gates: torch.Tensor | None, order: torch.Tensor | None, pre: torch.Tensor, h: torch.Tensor,
                        top_k: int, act: int, glu: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d items, d w1, d b1, d w2, d b2, d gates); an absent bias or gate gets an empty gradient."""
    rows, wide = pre.shape
    experts, _, in_features = w1.shape
    out_features, hidden = w2.shape[1:]
    dtype = w1.dtype
    blocks = _blocks(dtype)
    block_n = blocks["BLOCK_N"]
    hidden_blocks = triton.cdiv(hidden, block_n)
    d_pre = pre.new_empty(rows, wide)
    d_gates = grad.new_empty((rows, hidden_blocks) if gates is not None else (0, hidden_blocks), dtype=torch.float32)
    d_slots = items.new_empty(rows, in_features)
    d_w1, d_w2 = torch.empty_like(w1), torch.empty_like(w2)
    d_b1 = torch.empty_like(b1) if b1 is not None else w1.new_empty(0)
    d_b2 = torch.empty_like(b2) if b2 is not None else w2.new_empty(0)
    if rows:
        row_blocks = _row_blocks(rows, experts, blocks["BLOCK_M"])
        precision = _precision(dtype)
        _launch(_fc2_backward_kernel, (row_blocks, hidden_blocks),
                grad, order, w2, b2, gates, pre, offsets, d_pre, d_gates, rows, experts, top_k, out_features, hidden,
                grad.stride(0), w2.stride(0), w2.stride(1), _stride(b2), pre.stride(0), d_pre.stride(0),
                d_gates.stride(0), GATHER=order is not None, HAS_BIAS=b2 is not None, HAS_GATE=gates is not None,
                ACT=act, GLU=glu, PRECISION=precision, **blocks)
        _launch(_rows_kernel, (row_blocks, triton.cdiv(in_features, block_n)),
                d_pre, w1, None, None, order, offsets, d_slots, rows, experts, wide, in_features,
                d_pre.stride(0), w1.stride(0), w1.stride(2), w1.stride(1), 0, d_slots.stride(0),
                SCATTER=order is not None, HAS_BIAS=False, HAS_GATE=False, PRECISION=precision, **blocks)
        _outer(grad, order, top_k, gates, h, None, 1, offsets, d_w2, d_b2 if b2 is not None else None, blocks,
               precision)
        _outer(d_pre, None, 1, None, items, order, top_k, offsets, d_w1, d_b1 if b1 is not None else None, blocks,
               precision)
    else:
        for g in (d_w1, d_w2, d_b1, d_b2):
            g.zero_()
    d_items = d_slots if top_k == 1 else d_slots.view(-1, top_k, in_features).sum(1)
    d_gate = d_gates.sum(1).to(gates.dtype) if gates is not None else grad.new_empty(0)
    return d_items, d_w1, d_b1, d_w2, d_b2, d_gate


def _outer(a: torch.Tensor, a_order: torch.Tensor | None, a_div: int, gates: torch.Tensor | None, b: torch.Tensor,
           b_order: torch.Tensor | None, b_div: int, offsets: torch.Tensor, out: torch.Tensor,
           bias_out: torch.Tensor | None, blocks: dict, precision: str) -> None:
    """out[e] = sum over e's rows r of (gate[r] a[order[r] // div])^T b[...] (each row index by its own order and
    divisor, or r); bias_out[e] = the sum of those rows of a."""
    experts, m, n = out.shape
    tiles = triton.cdiv(m, blocks["BLOCK_M"]) * triton.cdiv(n, blocks["BLOCK_N"])
    _launch(_outer_kernel, (experts, tiles),
            a, a_order, gates, b, b_order, offsets, out, bias_out, a_div, b_div, m, n,
            a.stride(0), b.stride(0), out.stride(0), out.stride(1), _stride(bias_out),
            A_GATHER=a_order is not None, B_GATHER=b_order is not None, SCALE_A=gates is not None,
            BIAS_GRAD=bias_out is not None, PRECISION=precision, **blocks)


def _stride(t: torch.Tensor | None) -> int:
    return t.stride(0) if t is not None else 0


def _launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    """kernel[grid](*args) with None pointers (absent bias, gate, order) as the int 0: the kernels never read
    them, under constexpr flags."""
    args = [0 if a is None else a for a in args]
    _wrap(kernel)[grid](*args, **meta)


def _fake_ffn(items, offsets, w1, b1, w2, b2, gates, order, top_k, act, glu, save):
    rows = items.shape[0] if order is None else order.shape[0]
    out_dtype = w1.dtype if gates is None else torch.promote_types(w1.dtype, gates.dtype)
    return (items.new_empty(rows // top_k, w2.shape[1], dtype=out_dtype),
            items.new_empty((rows, w1.shape[1]) if save else (0, w1.shape[1]), dtype=w1.dtype),
            items.new_empty(rows, w2.shape[2], dtype=w1.dtype))


def _fake_ffn_backward(grad, items, offsets, w1, b1, w2, b2, gates, order, pre, h, top_k, act, glu):
    return (torch.empty_like(items), torch.empty_like(w1), torch.empty_like(b1) if b1 is not None else w1.new_empty(0),
            torch.empty_like(w2), torch.empty_like(b2) if b2 is not None else w2.new_empty(0),
            torch.empty_like(gates) if gates is not None else grad.new_empty(0))


def _wrap(kernel):
    return kernel


fused_ffn, fused_ffn_backward = _fused_ffn, _fused_ffn_backward
if triton is not None and hasattr(torch.library, "custom_op"):  # torch >= 2.4: opaque to torch.compile
    fused_ffn = torch.library.custom_op("moespec::fused_ffn", mutates_args=())(_fused_ffn)
    fused_ffn_backward = torch.library.custom_op("moespec::fused_ffn_backward", mutates_args=())(_fused_ffn_backward)
    fused_ffn.register_fake(_fake_ffn)
    fused_ffn_backward.register_fake(_fake_ffn_backward)


if triton is not None:

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
    def _fc1_kernel(x_ptr, order_ptr, w_ptr, b_ptr, offsets_ptr, pre_ptr, h_ptr,
                    rows, experts, top_k, in_features, hidden,
                    stride_x, stride_we, stride_wn, stride_be, stride_pre, stride_h,
                    GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE_PRE: tl.constexpr, ACT: tl.constexpr,
                    GLU: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """pre = x[order // k] @ w[e].T + b[e] (saved if SAVE_PRE), h = act(pre) (GLU: of both halves of w's rows,
        a = rows [0, H), b = rows [H, 2H)). The tail's rows are not written: nothing reads them."""
        expert, first, end = _segment_of_block(tl.program_id(0), offsets_ptr, experts, rows, BLOCK_M)
        if (expert < 0) | (expert == experts):
            return
        row = first + tl.arange(0, BLOCK_M)
        row_mask = row < end
        col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = col < hidden
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
                     stride_a, stride_we, stride_wn, stride_wk, stride_be, stride_out,
                     SCATTER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GATE: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[order[r]] = gate[r] * (a[r] @ w[e] + b[e]), w[e][k, n] at stride_wk, stride_wn (fc2: w2[e].T; the
        rows' gradient of fc1: w1[e]). The tail's rows get 0."""
        expert, first, end = _segment_of_block(tl.program_id(0), offsets_ptr, experts, rows, BLOCK_M)
        if expert < 0:
            return
        row = first + tl.arange(0, BLOCK_M)
        row_mask = row < end
        col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = col < out_features
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
    def _fc2_backward_kernel(dy_ptr, order_ptr, w_ptr, b_ptr, gate_ptr, pre_ptr, offsets_ptr, dpre_ptr, dgate_ptr,
                             rows, experts, top_k, out_features, hidden,
                             stride_dy, stride_we, stride_wk, stride_be, stride_pre, stride_dpre, stride_dgate,
                             GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GATE: tl.constexpr,
                             ACT: tl.constexpr, GLU: tl.constexpr, PRECISION: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """g = dy[order // k] @ w2[e] (w2[e][k, n] at stride_wk, 1); this column block's share of each row's gate
        gradient, g . h (+ dy . b2[e] in column block 0), into dgate[r, column block]; dpre = act'(pre) * gate * g.
        The tail's rows get a gate gradient of 0 (their dpre is never read)."""
        expert, first, end = _segment_of_block(tl.program_id(0), offsets_ptr, experts, rows, BLOCK_M)
        if expert < 0:
            return
        column_block = tl.program_id(1)
        row = first + tl.arange(0, BLOCK_M)
        row_mask = row < end
        if expert == experts:
            if HAS_GATE:
                tl.store(dgate_ptr + row * stride_dgate + column_block, tl.zeros((BLOCK_M,), tl.float32), mask=row_mask)
            return
        col = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = col < hidden
        source = row
        if GATHER:
            source = tl.load(order_ptr + row, mask=row_mask, other=0) // top_k
        dy_rows = dy_ptr + source.to(tl.int64)[:, None] * stride_dy
        w_cols = w_ptr + expert.to(tl.int64) * stride_we + col[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        bias_dot = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, out_features, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < out_features
            dy = tl.load(dy_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_cols + k[:, None] * stride_wk, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = _dot(dy.to(w_ptr.dtype.element_ty), w, acc, PRECISION)
            if HAS_GATE and HAS_BIAS:
                bias = tl.load(b_ptr + expert * stride_be + k, mask=k_mask, other=0.0).to(tl.float32)
                bias_dot += tl.sum(dy.to(tl.float32) * bias[None, :], axis=1)
        mask = row_mask[:, None] & col_mask[None, :]
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
            share = tl.sum(acc * h, axis=1)
            if HAS_BIAS:
                share += tl.where(column_block == 0, bias_dot, 0.0)
            tl.store(dgate_ptr + row * stride_dgate + column_block, share, mask=row_mask)
            acc *= tl.load(gate_ptr + row, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        dpre = dpre_ptr + row.to(tl.int64)[:, None] * stride_dpre + col[None, :]
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

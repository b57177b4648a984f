"""The scattered expert FFN of the forced "triton" step: the experts' FFN (fc1 -> act -> fc2) over routed pairs in
Triton kernels that gather their input rows and scatter their output rows themselves, after ScatterMoE (Tan et
al. 2024, "Scattered Mixture-of-Experts Implementation", github.com/shawntan/scattermoe, Apache-2.0): the pairs
are sorted by expert as indices, never as activations, and no padded or permuted copy of the rows is written.

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
                          dgate[r] = g . h[r]   (+ dy[order[r] // k] . b2[e], one [T, E] product outside)
                          dpre[r] = act'(pre[r]) * gate[r] * g                  activation backward in the epilogue
    _rows_kernel          dz[order[r]] = dpre[r] @ w1[e];  d items = dz.view(T, k, C).sum(1)
    weight gradients      dw2[e] = sum_r (gate dy)^T h,  db2[e] = sum_r gate dy;  dw1[e] = sum_r dpre^T x,  db1[e]:
                          16-bit weights on a GPU, torch's grouped GEMM on the gathered rows; else `_outer_kernel`

No host sync: each row-block program finds its expert and rows from the int32 segment ends on the device
(`_segment_of_block`), over a static grid of ceil(P / BLOCK_M) + E + 1 row blocks (E segments and the tail,
each rounding up once); the blocks past the segments return at once. Every launch's grid depends only on the
shapes. The row kernels run on a one-dimensional grid in a grouped raster (`_tile`): GROUP_M row blocks sweep
the column blocks together, so that their rows are read from memory once.

Experts: plain (GELU with erf, as timm's nn.GELU, or SiLU) or gated (GLU either order, e.g. SwiGLU), fc1 / fc2
biases optional; no inner norm, no dropout. Matmuls run in the weights' dtype (fp32, bf16, fp16; the items are
cast in the loads) with fp32 accumulation (`tl.dot`; fp32 as IEEE unless torch allows TF32 for CUDA matmuls).

The kernels, their tile configs and launchers are in `kernels/scattered.py`; this module is the torch op around
them. The two ops (`moespec::scattered_ffn`, `moespec::scattered_ffn_backward`) are torch custom ops with fake
functions: torch.compile traces them whole and runs them as they are. (`torch.library.triton_op` would let
Inductor see the kernels, but its fake call of an interpreted kernel fails under torch.compile, so the CPU
tests could not check it.)

Triton is optional: without it this module imports, and `unavailable` says why the step cannot run.
"""

from __future__ import annotations

import torch

from . import backend
from .activations import ACTIVATIONS, GLU_ORDERS
from .custom import custom_op
from .grouped import has_grouped_mm, segment_outer, segment_sum

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernels cannot run on `device` in `dtype`, or None where they can."""
    if not backend.INSTALLED:
        return "triton is not installed"
    if dtype not in DTYPES:
        return f"the kernels compute in {', '.join(str(d) for d in DTYPES)}, not {dtype}"
    if device.type == "cpu" and not backend.INTERPRETED:
        return "on CPU Triton kernels run only in its interpreter: set TRITON_INTERPRET=1 before importing moespec"
    if device.type not in ("cpu", "cuda"):
        return f"no Triton kernels for {device.type} here"
    return None


def scattered_experts(items: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
                  w2: torch.Tensor, b2: torch.Tensor | None, *, act: str, glu: str | None,
                  order: torch.Tensor | None = None, top_k: int = 1, gates: torch.Tensor | None = None,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """y[t] = sum over the k pairs (t, j) of gates * expert(items[t]), the experts' FFN in the scattered kernels.

    Args:
        items: [T, C] the items (any float dtype: cast in the kernels' loads).
        offsets: int32 [E] end of each expert's segment among the P sorted rows; rows past offsets[-1] give 0.
        w1, b1: [E, H', C], [E, H'] fc1 (H' = 2H for a GLU); w2, b2: [E, C', H], [E, C'] fc2; biases optional.
        act: "gelu" or "silu"; glu: None, "act_first" or "act_last" (`activations.GluOrder`).
        order: [P] slot t * k + j of each sorted row (`pairs.inverse_permutation(position)`); None: row r is
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
    return ScatteredExperts.apply(items.contiguous(), offsets, w1, b1, w2, b2, gates, order, top_k,
                              ACTIVATIONS.index(act), GLU_ORDERS.index(glu))


class ScatteredExperts(torch.autograd.Function):
    """The scattered FFN under autograd: forward saves fc1's pre-activations (not the gathered rows, nor any
    output), backward runs the three backward kernels (`scattered_ffn_backward`). Both are custom ops, so that
    torch.compile traces the step without a graph break."""

    @staticmethod
    def forward(ctx, items, offsets, w1, b1, w2, b2, gates, order, top_k, act, glu):
        save = any(ctx.needs_input_grad)  # grad mode is off in here
        y, pre, h = scattered_ffn(items, offsets, w1, b1, w2, b2, gates, order, top_k, act, glu, save)
        ctx.save_for_backward(items, offsets, w1, b1, w2, b2, gates, order, pre, h)
        ctx.top_k, ctx.act, ctx.glu = top_k, act, glu
        return y

    @staticmethod
    def backward(ctx, grad):
        items, offsets, w1, b1, w2, b2, gates, order, pre, h = ctx.saved_tensors
        grads = scattered_ffn_backward(grad.contiguous(), items, offsets, w1, b1, w2, b2, gates, order, pre, h,
                                       ctx.top_k, ctx.act, ctx.glu)
        d_items, d_w1, d_b1, d_w2, d_b2, d_gates = [g if need else None for g, need in
                                                    zip(grads, [ctx.needs_input_grad[i] for i in (0, 2, 3, 4, 5, 6)],
                                                        strict=True)]
        return d_items, None, d_w1, d_b1, d_w2, d_b2, d_gates, None, None, None, None


def _scattered_ffn(items: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
                   w2: torch.Tensor, b2: torch.Tensor | None, gates: torch.Tensor | None, order: torch.Tensor | None,
                   top_k: int, act: int, glu: int, save: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [T, C'], pre [P, H'] (empty unless `save`), h [P, H]): the forward of `scattered_experts`."""
    return backend.scattered_kernels.launch_forward(items, offsets, w1, b1, w2, b2, gates, order, top_k, act, glu, save)


def _scattered_ffn_backward(grad: torch.Tensor, items: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor,
                            b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
                            gates: torch.Tensor | None, order: torch.Tensor | None, pre: torch.Tensor,
                            h: torch.Tensor, top_k: int, act: int, glu: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                       torch.Tensor]:
    """(d items, d w1, d b1, d w2, d b2, d gates); an absent bias or gate gets an empty gradient."""
    if not pre.shape[0]:
        d_b1 = w1.new_zeros(b1.shape) if b1 is not None else w1.new_empty(0)
        d_b2 = w2.new_zeros(b2.shape) if b2 is not None else w2.new_empty(0)
        d_gate = gates.new_empty(0) if gates is not None else grad.new_empty(0)
        return items.new_zeros(items.shape), torch.zeros_like(w1), d_b1, torch.zeros_like(w2), d_b2, d_gate
    d_pre, d_gates, d_slots = backend.scattered_kernels.launch_backward_rows(grad, items, offsets, w1, w2, gates,
                                                                             order, pre, top_k, act, glu)
    d_w1, d_b1, d_w2, d_b2 = _weight_gradients(grad, items, offsets, w1, b1, w2, b2, gates, order, d_pre, h, top_k)
    d_items = d_slots if top_k == 1 else d_slots.view(-1, top_k, items.shape[1]).sum(1)
    d_gate = grad.new_empty(0)
    if gates is not None:
        d_gate = d_gates.sum(1)
        if b2 is not None:  # + dy . b2[e] of each pair: [T, E] products, one picked per pair
            d_gate = d_gate + _bias_products(grad, b2, offsets, order, top_k)
        d_gate = d_gate.to(gates.dtype)
    return d_items, d_w1, d_b1, d_w2, d_b2, d_gate


def _bias_products(grad: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor | None,
                   top_k: int) -> torch.Tensor:
    """[P] dy[item of r] . bias[expert of r] for each sorted row r (fp32); 0 for a tail row."""
    rows = order.shape[0] if order is not None else grad.shape[0]
    experts = bias.shape[0]
    row = torch.arange(rows, device=grad.device, dtype=offsets.dtype)
    expert = torch.searchsorted(offsets, row, right=True)  # E for a tail row
    item = row if order is None else order // top_k
    products = torch.mm(grad.float(), bias.float().t())  # [T, E]
    picked = products.view(-1).index_select(0, item.long() * experts + expert.clamp(max=experts - 1))
    return picked.masked_fill_(expert >= experts, 0)


def _weight_gradients(grad: torch.Tensor, items: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor,
                      b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None, gates: torch.Tensor | None,
                      order: torch.Tensor | None, d_pre: torch.Tensor, h: torch.Tensor, top_k: int):
    """(d w1, d b1, d w2, d b2) of each expert from its rows: dw2[e] = sum_r (gate dy)^T h, dw1[e] = sum_r
    dpre^T x. In 16 bits on a GPU, torch's grouped GEMM (`grouped.segment_outer`, CUTLASS's tuned sm90 kernels)
    over the gathered rows, made once each (a [P, C] pass, a fraction of the GEMM's time); elsewhere (fp32,
    where torch's grouped GEMM reads the offsets on the host; widths not 16-byte aligned; the interpreter) the
    Triton kernel that gathers the rows in its loads."""
    dtype = w1.dtype
    if _grouped_weight_gradients(w1, w2):
        item = None if order is None else order // top_k
        dy = grad if item is None else grad.index_select(0, item)
        dy = (dy * gates.unsqueeze(-1) if gates is not None else dy).to(dtype)
        x = (items if item is None else items.index_select(0, item)).to(dtype)
        d_w2 = segment_outer(dy, h, offsets)
        d_w1 = segment_outer(d_pre, x, offsets)
        # contiguous, as the fake function's outputs are (torch.compile's inductor checks the strides)
        d_b2 = segment_sum(dy, offsets).to(dtype).contiguous() if b2 is not None else w2.new_empty(0)
        d_b1 = segment_sum(d_pre, offsets).to(dtype).contiguous() if b1 is not None else w1.new_empty(0)
        return d_w1, d_b1, d_w2, d_b2
    d_w1, d_w2 = torch.empty_like(w1), torch.empty_like(w2)
    d_b1 = torch.empty_like(b1) if b1 is not None else None
    d_b2 = torch.empty_like(b2) if b2 is not None else None
    backend.scattered_kernels.launch_outer(grad, order, top_k, gates, h, None, 1, offsets, d_w2, d_b2)
    backend.scattered_kernels.launch_outer(d_pre, None, 1, None, items, order, top_k, offsets, d_w1, d_b1)
    return d_w1, w1.new_empty(0) if d_b1 is None else d_b1, d_w2, w2.new_empty(0) if d_b2 is None else d_b2


WEIGHT_GRADIENTS = "auto"  # "auto" | "grouped_mm" | "triton": how `_weight_gradients` runs (tests force each)


def _grouped_weight_gradients(w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the weight gradients go through torch's grouped GEMM: 16-bit weights on a GPU, every width
    16-byte aligned; or where forced (`WEIGHT_GRADIENTS`)."""
    if WEIGHT_GRADIENTS != "auto":
        return WEIGHT_GRADIENTS == "grouped_mm"
    widths = (*w1.shape[1:], *w2.shape[1:])
    return (w1.device.type == "cuda" and w1.dtype in (torch.bfloat16, torch.float16) and has_grouped_mm()
            and all(width * w1.element_size() % 16 == 0 for width in widths))


def _scattered_ffn_shape(items, offsets, w1, b1, w2, b2, gates, order, top_k, act, glu, save):
    rows = items.shape[0] if order is None else order.shape[0]
    out_dtype = w1.dtype if gates is None else torch.promote_types(w1.dtype, gates.dtype)
    return (items.new_empty(rows // top_k, w2.shape[1], dtype=out_dtype),
            items.new_empty((rows, w1.shape[1]) if save else (0, w1.shape[1]), dtype=w1.dtype),
            items.new_empty(rows, w2.shape[2], dtype=w1.dtype))


def _scattered_ffn_backward_shape(grad, items, offsets, w1, b1, w2, b2, gates, order, pre, h, top_k, act, glu):
    return (torch.empty_like(items), torch.empty_like(w1), torch.empty_like(b1) if b1 is not None else w1.new_empty(0),
            torch.empty_like(w2), torch.empty_like(b2) if b2 is not None else w2.new_empty(0),
            torch.empty_like(gates) if gates is not None else grad.new_empty(0))


scattered_ffn, scattered_ffn_backward = _scattered_ffn, _scattered_ffn_backward
if backend.INSTALLED:
    scattered_ffn = custom_op("scattered_ffn", _scattered_ffn, fake=_scattered_ffn_shape)
    scattered_ffn_backward = custom_op("scattered_ffn_backward", _scattered_ffn_backward,
                                       fake=_scattered_ffn_backward_shape)

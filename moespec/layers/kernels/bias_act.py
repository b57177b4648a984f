"""The Triton kernels of `ops/bias_act.py` (its docstring says what they compute) and their launchers, `launch`
and `launch_backward`, which allocate the outputs and launch on the inputs' device (CUDA, or CPU under
`TRITON_INTERPRET=1`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _act, _act_grad

CONFIG = {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4}  # elementwise tiles of 4096 elements, 32 per thread


@triton.jit
def _pre_activation(pre_ptr, bias_ptr, expert_ptr, rows, columns, experts, stride_pre, stride_bias,
                    OFFSET, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(z [BLOCK_M, BLOCK_N] in fp32, its mask): pre[r, OFFSET + c] + bias[expert[r], OFFSET + c] of this
    program's tile; a row's bias is 0 where its expert is `experts` (a dropped row)."""
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    column = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = row < rows
    mask = row_mask[:, None] & (column[None, :] < columns)
    expert = tl.load(expert_ptr + row, mask=row_mask, other=experts)
    z = tl.load(pre_ptr + row[:, None].to(tl.int64) * stride_pre + OFFSET + column[None, :], mask=mask,
                other=0.0).to(tl.float32)
    kept = mask & (expert[:, None] < experts)
    bias = tl.load(bias_ptr + expert[:, None].to(tl.int64) * stride_bias + OFFSET + column[None, :], mask=kept,
                   other=0.0)
    return z + bias.to(tl.float32), mask


@triton.jit
def _bias_act_kernel(pre_ptr, bias_ptr, expert_ptr, h_ptr, rows, hidden, experts, stride_pre, stride_bias,
                     stride_h, ACT: tl.constexpr, GLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """h[r, c] = act(z[r, c]) (GLU 1: act(a) * b, GLU 2: a * act(b), with a = z[:, c], b = z[:, hidden + c]),
    z = pre + bias[expert[r]], over [BLOCK_M, BLOCK_N] tiles of h [rows, hidden]."""
    a, mask = _pre_activation(pre_ptr, bias_ptr, expert_ptr, rows, hidden, experts, stride_pre, stride_bias, 0,
                              BLOCK_M, BLOCK_N)
    if GLU == 0:
        h = _act(a, ACT)
    else:
        b, mask = _pre_activation(pre_ptr, bias_ptr, expert_ptr, rows, hidden, experts, stride_pre, stride_bias,
                                  hidden, BLOCK_M, BLOCK_N)
        if GLU == 1:
            h = _act(a, ACT) * b
        else:
            h = a * _act(b, ACT)
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    column = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(h_ptr + row[:, None].to(tl.int64) * stride_h + column[None, :], h.to(h_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _bias_act_backward_kernel(grad_ptr, pre_ptr, bias_ptr, expert_ptr, dpre_ptr, rows, hidden, experts,
                              stride_grad, stride_pre, stride_bias, stride_dpre, ACT: tl.constexpr,
                              GLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dpre = d h / d pre * grad over [BLOCK_M, BLOCK_N] tiles of grad [rows, hidden] (GLU: both halves of
    dpre [rows, 2 hidden]), z recomputed from pre and the bias as in `_bias_act_kernel`."""
    a, mask = _pre_activation(pre_ptr, bias_ptr, expert_ptr, rows, hidden, experts, stride_pre, stride_bias, 0,
                              BLOCK_M, BLOCK_N)
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    column = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.load(grad_ptr + row[:, None].to(tl.int64) * stride_grad + column[None, :], mask=mask,
                other=0.0).to(tl.float32)
    out = dpre_ptr + row[:, None].to(tl.int64) * stride_dpre + column[None, :]
    if GLU == 0:
        tl.store(out, (g * _act_grad(a, ACT)).to(dpre_ptr.dtype.element_ty), mask=mask)
    else:
        b, mask = _pre_activation(pre_ptr, bias_ptr, expert_ptr, rows, hidden, experts, stride_pre, stride_bias,
                                  hidden, BLOCK_M, BLOCK_N)
        if GLU == 1:  # h = act(a) * b
            da = g * b * _act_grad(a, ACT)
            db = g * _act(a, ACT)
        else:  # h = a * act(b)
            da = g * _act(b, ACT)
            db = g * a * _act_grad(b, ACT)
        tl.store(out, da.to(dpre_ptr.dtype.element_ty), mask=mask)
        tl.store(out + hidden, db.to(dpre_ptr.dtype.element_ty), mask=mask)


def _bias_arg(pre: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """(the bias the kernels read, its experts): without a bias, one zero and no experts, so that every row
    reads none (the kernels read no bias for a row whose expert is not below the experts)."""
    return (pre.new_zeros(1, 1), 0) if bias is None else (bias.contiguous(), bias.shape[0])


def launch(pre: torch.Tensor, bias: torch.Tensor | None, expert: torch.Tensor, act: int, glu: int) -> torch.Tensor:
    """The forward kernel on `pre`'s device (CUDA, or CPU under the interpreter)."""
    rows, wide = pre.shape
    hidden = wide // 2 if glu else wide
    (bias, experts), pre, expert = _bias_arg(pre, bias), pre.contiguous(), expert.contiguous()
    h = pre.new_empty(rows, hidden)
    if rows and hidden:
        grid = (triton.cdiv(rows, CONFIG["BLOCK_M"]), triton.cdiv(hidden, CONFIG["BLOCK_N"]))
        _bias_act_kernel[grid](pre, bias, expert, h, rows, hidden, experts, pre.stride(0), bias.stride(0),
                               h.stride(0), ACT=act, GLU=glu, **CONFIG)
    return h


def launch_backward(grad: torch.Tensor, pre: torch.Tensor, bias: torch.Tensor | None, expert: torch.Tensor, act: int,
                    glu: int) -> torch.Tensor:
    """The backward kernel on `pre`'s device: d pre [S, H']."""
    rows, hidden = grad.shape
    (bias, experts), grad, pre, expert = _bias_arg(pre, bias), grad.contiguous(), pre.contiguous(), expert.contiguous()
    dpre = torch.empty_like(pre)
    if rows and hidden:
        grid = (triton.cdiv(rows, CONFIG["BLOCK_M"]), triton.cdiv(hidden, CONFIG["BLOCK_N"]))
        _bias_act_backward_kernel[grid](grad, pre, bias, expert, dpre, rows, hidden, experts, grad.stride(0),
                                        pre.stride(0), bias.stride(0), dpre.stride(0), ACT=act, GLU=glu, **CONFIG)
    return dpre

"""fc1's bias and the activation in one pass over the rows, for the grouped step (`steps/grouped.py`): fc1 runs
as a grouped matmul without bias, and `bias_act` adds each row's expert's bias and applies the activation (GLU:
and the gating) where the rows are read anyway. No copy of the weight bank carries the bias (a bias column
concatenated to the bank would copy the whole bank with its biases at every step).

    bias_act(pre, bias, expert, offsets)   h[r] = act(pre[r] + bias[expert[r]])     plain experts
                                           h[r] = act(a) * b   or   a * act(b)      GLU, (a, b) = halves of the sum
  backward:
    bias_act_backward                      dpre[r] = d h[r] / d pre[r] * dh[r]       the same sum recomputed
    the bias gradient                      dbias[e] = sum over e's rows of dpre      (`grouped.segment_sum`)

Rows are sorted by expert: `expert` [S] is each row's expert, E for a row a capacity dropped (`steps.rows.Segments`),
which takes no bias; `offsets` int32 [E] the segments' ends. The sum and the activation are computed in fp32
(fp64 for fp64 inputs) and h is written in pre's dtype; the bias is read in its own dtype (under autocast, the
fp32 parameter itself: no cast). Activations: GELU with erf (timm's nn.GELU) and SiLU, as `activations.activation`
names them.

`moespec::bias_act` and `moespec::bias_act_backward` are torch custom ops with fake functions, the first with its
autograd formula. On CUDA with Triton they run one kernel each (`kernels/bias_act.py`), elsewhere plain torch
ops (the CPU, and a GPU without Triton). Under `TRITON_INTERPRET=1` the kernels run on CPU in Triton's
interpreter (tests/layers/test_bias_act.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import backend
from .activations import ACTIVATIONS, GLU_ORDERS
from .custom import custom_op
from .grouped import segment_sum


def bias_act(pre: torch.Tensor, bias: torch.Tensor | None, expert: torch.Tensor, offsets: torch.Tensor, *, act: str,
             glu: str | None, traced: bool = False) -> torch.Tensor:
    """h [S, H]: act(pre + bias[expert]) of rows sorted by expert (GLU: gated, pre [S, 2H]).

    Args:
        pre: [S, H'] fc1's output without bias (H' = 2H for a GLU).
        bias: [E, H'] fc1's bias, any float dtype; None: none (the activation alone, GLU: and the gating).
        expert: [S] int64 expert of each row (E: a dropped row, no bias).
        offsets: int32 [E] end of each expert's segment (for the bias gradient).
        act: "gelu" or "silu"; glu: None, "act_first" or "act_last" (`activations.GluOrder`).
        traced: the layer's `Mode.traced` (the bias gradient's grouped sum).
    """
    return _bias_act(pre, bias, expert, offsets, ACTIVATIONS.index(act), GLU_ORDERS.index(glu), traced)


def _sum(pre: torch.Tensor, bias: torch.Tensor | None, expert: torch.Tensor) -> torch.Tensor:
    """[S, H'] fp32 pre + bias[expert], 0 bias for the rows whose expert is E (and without a bias)."""
    dtype = _compute_dtype(pre, bias)
    if bias is None:
        return pre.to(dtype)
    bias = F.pad(bias.to(dtype), (0, 0, 0, 1))  # [E + 1, H']: row E for the dropped rows
    return pre.to(dtype) + bias.index_select(0, expert)


def _compute_dtype(pre: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype:
    """fp32, or fp64 where either input is: never fewer bits than the inputs."""
    return torch.promote_types(torch.float32, pre.dtype if bias is None else torch.promote_types(pre.dtype, bias.dtype))


def _act(z: torch.Tensor, act: int) -> torch.Tensor:
    return F.gelu(z) if act == 0 else F.silu(z)


def _act_backward(grad: torch.Tensor, z: torch.Tensor, act: int) -> torch.Tensor:
    if act == 0:
        return torch.ops.aten.gelu_backward(grad, z)
    return torch.ops.aten.silu_backward(grad, z)


def _torch_forward(pre, bias, expert, act, glu):
    z = _sum(pre, bias, expert)
    if glu == 0:
        return _act(z, act).to(pre.dtype)
    a, b = z.chunk(2, dim=-1)
    return (_act(a, act) * b if glu == 1 else a * _act(b, act)).to(pre.dtype)


def _torch_backward(grad, pre, bias, expert, act, glu):
    z = _sum(pre, bias, expert)
    grad = grad.to(z.dtype)
    if glu == 0:
        return _act_backward(grad, z, act).to(pre.dtype)
    a, b = z.chunk(2, dim=-1)
    if glu == 1:  # h = act(a) * b
        halves = _act_backward(grad * b, a, act), grad * _act(a, act)
    else:  # h = a * act(b)
        halves = grad * _act(b, act), _act_backward(grad * a, b, act)
    return torch.cat(halves, dim=-1).to(pre.dtype)


def _bias_act(pre: torch.Tensor, bias: Optional[torch.Tensor], expert: torch.Tensor, offsets: torch.Tensor, act: int,
              glu: int, traced: bool) -> torch.Tensor:
    if backend.on_device(pre, bias):
        return backend.bias_act_kernels.launch(pre, bias, expert, act, glu)
    return _torch_forward(pre, bias, expert, act, glu)


def _bias_act_backward(grad: torch.Tensor, pre: torch.Tensor, bias: Optional[torch.Tensor], expert: torch.Tensor,
                       act: int, glu: int) -> torch.Tensor:
    if backend.on_device(pre, bias):
        return backend.bias_act_kernels.launch_backward(grad, pre, bias, expert, act, glu)
    return _torch_backward(grad, pre, bias, expert, act, glu)


def _setup_context(ctx, inputs, output) -> None:
    pre, bias, expert, offsets, act, glu, traced = inputs
    ctx.save_for_backward(pre, bias, expert, offsets)
    ctx.act, ctx.glu, ctx.traced = act, glu, traced


def _backward(ctx, grad):
    pre, bias, expert, offsets = ctx.saved_tensors
    need_pre, need_bias = ctx.needs_input_grad[:2]
    dpre = _bias_act_backward_op(grad.contiguous(), pre, bias, expert, ctx.act, ctx.glu)
    dbias = segment_sum(dpre, offsets, traced=ctx.traced).to(bias.dtype) if bias is not None and need_bias else None
    return dpre if need_pre else None, dbias, None, None, None, None, None


def _bias_act_shape(pre, bias, expert, offsets, act, glu, traced):
    return pre.new_empty(pre.shape[0], pre.shape[1] // 2 if glu else pre.shape[1])


def _bias_act_backward_shape(grad, pre, bias, expert, act, glu):
    return torch.empty_like(pre)


_bias_act_backward_op = custom_op("bias_act_backward", _bias_act_backward, fake=_bias_act_backward_shape)
_bias_act = custom_op("bias_act", _bias_act, fake=_bias_act_shape, backward=_backward, setup=_setup_context)

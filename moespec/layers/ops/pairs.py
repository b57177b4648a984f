"""Routing and the combine in a handful of ops: what a top-k layer runs around its expert matmuls on the sync-free
path (`Mode.pair_ops`: a GPU, torch.compile, `device_path()`), each one torch custom op.

    softmax_topk(logits, k)       probs = softmax(logits); weights, experts = the top k of probs
    sort_pairs(experts, weights)  the (item, expert) pairs sorted by expert, stably: each row's item, expert and
                                  gate, the experts' counts and segment ends, and each choice's row (`position`)
    combine(out, gates, position) y[t] = sum over j of gates[t, j] * (out[position[t, j]] + bias[experts[t, j]])

Their gradients are ops of the same kind: softmax_topk's is one pass over [U, E]; sort_pairs' gate gradient is a
gather at `position` (no `index_put(accumulate)`); combine's is one pass writing each row's gradient and each
choice's gate gradient, and a gather-sum (`combine` without gates) takes the gather's gradient back to the items.

On CUDA with Triton each op runs its kernels (`kernels/pairs.py`: one each, two for sort_pairs: a histogram per
block of choices, then every choice's row), elsewhere the plain torch ops below, which compute the same (the CPU,
float64, a GPU without Triton). Under `TRITON_INTERPRET=1` the kernels run on CPU in Triton's interpreter
(tests/layers/test_pair_kernels.py). Values: probs, weights and the combine's sums in fp32 (fp64 for fp64 inputs).

The sort helpers of the plain torch ops (`stable_argsort`, `narrow_ids`, `inverse_permutation`) are here too:
`routing.group_pairs` runs them for a capacity or a drop, and `sort_pairs` on CPU. They take `exporting` (the
layer's `Mode.exporting`): ONNX has no stable sort.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import backend
from .custom import custom_op
from .grouped import segment_sum

MAX_KERNEL_EXPERTS = 1024  # the kernels hold a row of E scores in registers


def _compute_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    """fp32, or fp64 where an input is: never fewer bits than the inputs."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def stable_argsort(key: torch.Tensor, descending: bool = False, *, exporting: bool) -> torch.Tensor:
    """`torch.argsort(key, stable=True)`. ONNX has no stable sort, so while exporting an integer key is made
    unique (key * n + position: the same order), and a float key (gate values) is sorted plainly, its ties
    having probability 0."""
    if not exporting:
        return torch.argsort(key, descending=descending, stable=True)
    if key.is_floating_point():
        return torch.argsort(key, descending=descending)
    position = torch.arange(key.numel(), device=key.device)
    return torch.argsort((-key if descending else key) * key.numel() + position)


def narrow_ids(ids: torch.Tensor, count: int, *, exporting: bool) -> torch.Tensor:
    """Ids in [0, count) in the narrowest integer dtype that holds them, so that a radix sort on a GPU runs one
    8-bit pass per byte of the dtype (uint8 for up to 256 experts: one pass, where int64 took eleven kernels).
    Not while exporting, where `stable_argsort` makes the key unique by arithmetic that needs the width."""
    if exporting:
        return ids
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if count <= torch.iinfo(dtype).max + 1:
            return ids.to(dtype)
    return ids


def inverse_permutation(permutation: torch.Tensor) -> torch.Tensor:
    """The inverse of a permutation of 0..n-1 (a scatter of distinct indices: deterministic)."""
    return torch.empty_like(permutation).scatter_(0, permutation, torch.arange(permutation.numel(),
                                                                               device=permutation.device))


# softmax + top-k ------------------------------------------------------------------------------------------------

def _softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend.on_device(logits) and logits.shape[-1] <= MAX_KERNEL_EXPERTS:
        return backend.pair_kernels.launch_softmax_topk(logits, k)
    probs = logits.to(_compute_dtype(logits)).softmax(dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    return probs, weights, experts


def _softmax_topk_backward(grad_probs: Optional[torch.Tensor], grad_weights: Optional[torch.Tensor],
                           probs: torch.Tensor, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if backend.on_device(probs) and probs.shape[-1] <= MAX_KERNEL_EXPERTS:
        return backend.pair_kernels.launch_softmax_topk_backward(grad_probs, grad_weights, probs, experts, dtype)
    g = torch.zeros_like(probs) if grad_probs is None else grad_probs.to(probs.dtype)
    if grad_weights is not None:
        g = g.scatter_add(1, experts, grad_weights.to(probs.dtype))
    return (probs * (g - (g * probs).sum(dim=-1, keepdim=True))).to(dtype)


# the pairs sorted by expert ------------------------------------------------------------------------------------

def _sort_pairs(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend.on_device(weights) and num_experts <= MAX_KERNEL_EXPERTS:
        item, row_expert, pair_weights, counts, ends, position = backend.pair_kernels.launch_sort_pairs(
            experts, weights, num_experts, dtype)
        return pair_weights, item, row_expert, counts, ends, position
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    order = stable_argsort(narrow_ids(flat, num_experts, exporting=False), exporting=False)  # never while exporting
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return (weights.reshape(-1)[order].to(dtype), order // k, flat[order], counts,
            torch.cumsum(counts, 0).to(torch.int32), inverse_permutation(order).view(tokens, k))


# the combine ---------------------------------------------------------------------------------------------------

def _combine(out: torch.Tensor, gates: Optional[torch.Tensor], position: torch.Tensor, experts: Optional[torch.Tensor],
             bias: Optional[torch.Tensor], ends: Optional[torch.Tensor], dtype: torch.dtype,
             traced: bool) -> torch.Tensor:
    if backend.on_device(out, gates, bias):
        return backend.pair_kernels.launch_combine(out, gates, position, experts, bias, dtype)
    tokens, k = position.shape
    compute = _compute_dtype(out, gates, bias)
    picked = out.index_select(0, position.reshape(-1)).view(tokens, k, out.shape[-1]).to(compute)
    if bias is not None:
        picked = picked + bias.to(compute).index_select(0, experts.reshape(-1)).view_as(picked)
    if gates is not None:
        picked = picked * gates.to(compute).unsqueeze(-1)
    return picked.sum(1).to(dtype)


def _combine_backward(grad: torch.Tensor, out: torch.Tensor, gates: torch.Tensor, position: torch.Tensor,
                      experts: Optional[torch.Tensor], bias: Optional[torch.Tensor], need_out: bool,
                      need_gates: bool) -> list[torch.Tensor]:
    """[grad_out [P, C'] where `need_out`, grad_gates [T, k] where `need_gates`]."""
    if backend.on_device(grad, out, gates, bias):
        grads = backend.pair_kernels.launch_combine_backward(grad, out, gates, position, experts, bias, need_out,
                                                             need_gates)
        return [g for g in grads if g is not None]
    tokens, k = position.shape
    compute = _compute_dtype(grad, out, gates, bias)
    grad = grad.to(compute)
    flat = position.reshape(-1)
    grad_out = grad_gates = None
    if need_out:  # row position[t, j] is choice (t, j)'s: a scatter of distinct rows, a permutation
        rows = (gates.to(compute).unsqueeze(-1) * grad.unsqueeze(1)).view(tokens * k, -1).to(out.dtype)
        grad_out = torch.empty_like(out).index_copy_(0, flat, rows)
    if need_gates:
        picked = out.index_select(0, flat).view(tokens, k, out.shape[-1]).to(compute)
        if bias is not None:
            picked = picked + bias.to(compute).index_select(0, experts.reshape(-1)).view_as(picked)
        grad_gates = torch.bmm(picked, grad.unsqueeze(-1)).squeeze(-1).to(gates.dtype)
    return [g for g in (grad_out, grad_gates) if g is not None]


def _softmax_topk_shape(logits, k):
    dtype = _compute_dtype(logits)
    rows = logits.shape[0]
    return (logits.new_empty(logits.shape, dtype=dtype), logits.new_empty(rows, k, dtype=dtype),
            logits.new_empty(rows, k, dtype=torch.long))


def _softmax_topk_backward_shape(grad_probs, grad_weights, probs, experts, dtype):
    return probs.new_empty(probs.shape, dtype=dtype)


def _sort_pairs_shape(experts, weights, num_experts, dtype):
    pairs = experts.numel()
    return (weights.new_empty(pairs, dtype=dtype), experts.new_empty(pairs), experts.new_empty(pairs),
            experts.new_empty(num_experts), experts.new_empty(num_experts, dtype=torch.int32),
            experts.new_empty(experts.shape))


def _combine_shape(out, gates, position, experts, bias, ends, dtype, traced):
    return out.new_empty(position.shape[0], out.shape[-1], dtype=dtype)


def _combine_backward_shape(grad, out, gates, position, experts, bias, need_out, need_gates):
    return [torch.empty_like(t) for t, need in ((out, need_out), (gates, need_gates)) if need]


def _softmax_topk_setup(ctx, inputs, output):
    probs, _, experts = output
    ctx.save_for_backward(probs, experts)
    ctx.dtype = inputs[0].dtype
    ctx.set_materialize_grads(False)


def _softmax_topk_grad(ctx, grad_probs, grad_weights, _):
    probs, experts = ctx.saved_tensors
    if grad_probs is None and grad_weights is None:
        return None, None
    return _softmax_topk_backward_op(grad_probs, grad_weights, probs, experts, ctx.dtype), None


def _sort_pairs_setup(ctx, inputs, output):
    ctx.save_for_backward(output[5])
    ctx.weights_dtype = inputs[1].dtype
    ctx.set_materialize_grads(False)


def _sort_pairs_grad(ctx, grad_pair_weights, _item, _expert, _counts, _ends, _position):
    (position,) = ctx.saved_tensors
    if grad_pair_weights is None:
        return None, None, None, None
    grad = grad_pair_weights.index_select(0, position.reshape(-1)).view(position.shape)  # a gather: no atomics
    return None, grad.to(ctx.weights_dtype), None, None


def _combine_setup(ctx, inputs, output):
    out, gates, position, experts, bias, ends, dtype, traced = inputs
    ctx.save_for_backward(out, gates, position, experts, bias, ends)
    ctx.traced = traced


def _combine_grad(ctx, grad):
    out, gates, position, experts, bias, ends = ctx.saved_tensors
    need_out, need_gates, _, _, need_bias = ctx.needs_input_grad[:5]
    if gates is None:  # a gather-sum: its gradient is each row's item's gradient
        return grad.to(out.dtype).index_select(0, _rows_to_items(position)), None, None, None, None, None, None, None
    rows = need_out or bias is not None and need_bias
    grads = _combine_backward_op(grad.contiguous(), out, gates, position, experts, bias, rows, need_gates)
    grad_out, grad_gates = grads.pop(0) if rows else None, grads.pop(0) if need_gates else None
    grad_bias = None
    if bias is not None and need_bias:  # the sum of each expert's rows' gradients: the rows are sorted by expert
        grad_bias = segment_sum(grad_out, ends, traced=ctx.traced).to(bias.dtype)
    return grad_out if need_out else None, grad_gates, None, None, grad_bias, None, None, None


_softmax_topk_backward_op = custom_op("softmax_topk_backward", _softmax_topk_backward,
                                      fake=_softmax_topk_backward_shape)
_combine_backward_op = custom_op("combine_backward", _combine_backward, fake=_combine_backward_shape)
_softmax_topk = custom_op("softmax_topk", _softmax_topk, fake=_softmax_topk_shape, backward=_softmax_topk_grad,
                          setup=_softmax_topk_setup)
_sort_pairs = custom_op("sort_pairs", _sort_pairs, fake=_sort_pairs_shape, backward=_sort_pairs_grad,
                        setup=_sort_pairs_setup)
_combine = custom_op("combine", _combine, fake=_combine_shape, backward=_combine_grad, setup=_combine_setup)


def _rows_to_items(position: torch.Tensor) -> torch.Tensor:
    """[P] the item of each row, from position [T, k] (row position[t, j] is item t's)."""
    tokens, k = position.shape
    items = torch.arange(tokens, device=position.device).repeat_interleave(k)
    return torch.empty_like(items).index_copy_(0, position.reshape(-1), items)


def softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs [U, E], weights [U, k], experts [U, k]): the softmax of `logits` (computed in fp32, or fp64) and
    its k largest values with their experts, largest first. Differentiable in `logits` through probs and weights."""
    return _softmax_topk(logits, k)


def sort_pairs(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, dtype: torch.dtype):
    """The choices `experts` [T, k] (gates `weights` [T, k]) as (item, expert) pairs sorted by expert, choices in
    item order within each expert (a stable sort). Returns (item [P], row_expert [P], pair_weights [P] in `dtype`,
    counts [E], ends int32 [E], position [T, k]: the row of each choice). Differentiable in `weights`.
    (The op returns pair_weights first: torch's opcheck sums the outputs, starting with the first.)"""
    pair_weights, item, row_expert, counts, ends, position = _sort_pairs(experts, weights, num_experts, dtype)
    return item, row_expert, pair_weights, counts, ends, position


def combine(out: torch.Tensor, gates: Optional[torch.Tensor], position: torch.Tensor, *, dtype: torch.dtype,
            experts: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
            ends: Optional[torch.Tensor] = None, traced: bool = False) -> torch.Tensor:
    """[T, C'] in `dtype`: sum over j < k of gates[t, j] * (out[position[t, j]] + bias[experts[t, j]]), the rows
    `out` [P, C'] sorted by expert. gates None: the plain sum of each item's k rows (the gather's gradient).
    With `bias` [E, C'], `experts` [T, k] and the segments' `ends` (for the bias gradient) are given; `traced`:
    the layer's `Mode.traced` (the bias gradient's grouped sum)."""
    return _combine(out, gates, position, experts, bias, ends, dtype, traced)

"""Triton kernels of the routing and the combine, and the `launch_*` functions that allocate their outputs and
launch them on the inputs' device (CUDA, or CPU under `TRITON_INTERPRET=1`); `ops/pairs.py` is their torch op.

    launch_softmax_topk            probs = softmax(logits), (weights, experts) = its top k, lowest index first on ties
    launch_softmax_topk_backward   grad_logits of probs and weights
    launch_sort_pairs              the T k choices sorted stably by expert: each pair's item, expert, weight and
                                   position, the experts' counts and segment ends
    launch_combine                 y[t] = sum_j gate[t, j] (out[position[t, j]] + bias[expert[t, j]])
    launch_combine_backward        grad_out and grad_gates of the combine

Every kernel computes in fp32, masks any size, computes pointer offsets in int64 and uses no atomics: the results
are deterministic. A tensor that may be None is replaced by a dummy and not read, under a constexpr flag.
tests/layers/test_pair_kernels.py runs each launch in Triton's interpreter against its torch definition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COMBINE_CONFIG = {"BLOCK_T": 32, "BLOCK_C": 128, "num_warps": 4}  # [32, 128] tiles: 32 fp32 per thread
PAIRS_CONFIG = {"BLOCK_P": 1024, "BLOCK_E": 8, "BLOCK_B": 512, "num_warps": 8}  # one-hot tiles [1024, 8]
TILE = 4096  # elements of a softmax tile: BLOCK_U rows of BLOCK_E experts


def softmax_topk_config(num_experts: int) -> dict:
    """Blocks of the softmax kernels: a power of two at least `num_experts` wide, rows up to TILE elements, and
    warps for 16 elements a thread (at 32, the backward spilled registers at 64 experts)."""
    block_e = triton.next_power_of_2(max(num_experts, 2))
    block_u = max(1, min(64, TILE // block_e))
    return {"BLOCK_U": block_u, "BLOCK_E": block_e, "num_warps": max(1, min(8, block_u * block_e // 512))}


def combine_backward_config(top_k: int) -> dict:
    """Blocks of the combine's backward: COMBINE_CONFIG's, and the k gate gradients of an item in one tile."""
    return {**COMBINE_CONFIG, "BLOCK_K": triton.next_power_of_2(max(top_k, 2))}


@triton.jit
def _softmax_topk_kernel(logits_ptr, probs_ptr, weights_ptr, experts_ptr, rows, num_experts, top_k,
                         BLOCK_U: tl.constexpr, BLOCK_E: tl.constexpr):
    """probs [rows, E] = softmax of logits' rows, and its k largest (weights [rows, k], experts [rows, k] int64)
    in descending order, the lowest expert first among equal values, over blocks of BLOCK_U rows."""
    row = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    column = tl.arange(0, BLOCK_E)
    row_mask = row < rows
    column_mask = column < num_experts
    mask = row_mask[:, None] & column_mask[None, :]
    offset = row[:, None].to(tl.int64) * num_experts + column[None, :]
    x = tl.load(logits_ptr + offset, mask=mask, other=float("-inf")).to(tl.float32)
    peak = tl.where(row_mask, tl.max(x, axis=1), 0.0)
    e = tl.exp(x - peak[:, None])
    total = tl.where(row_mask, tl.sum(e, axis=1), 1.0)
    probs = e / total[:, None]
    tl.store(probs_ptr + offset, probs, mask=mask)
    left = tl.where(column_mask[None, :], probs, float("-inf"))
    out = row.to(tl.int64) * top_k
    for j in range(top_k):
        best = tl.max(left, axis=1)
        chosen = tl.min(tl.where(left == best[:, None], column[None, :], BLOCK_E), axis=1)
        chosen = tl.minimum(chosen, num_experts - 1)  # a NaN row matches no value: its indices stay in range
        tl.store(weights_ptr + out + j, best, mask=row_mask)
        tl.store(experts_ptr + out + j, chosen.to(tl.int64), mask=row_mask)
        left = tl.where(column[None, :] == chosen[:, None], float("-inf"), left)


@triton.jit
def _softmax_topk_backward_kernel(grad_probs_ptr, grad_weights_ptr, probs_ptr, experts_ptr, grad_logits_ptr, rows,
                                  num_experts, top_k, HAS_GRAD_PROBS: tl.constexpr, HAS_GRAD_WEIGHTS: tl.constexpr,
                                  BLOCK_U: tl.constexpr, BLOCK_E: tl.constexpr):
    """grad_logits = probs (g - sum(g probs)) with g = grad_probs + grad_weights added at the chosen experts'
    columns (softmax's backward through the top k's gather), over blocks of BLOCK_U rows."""
    row = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    column = tl.arange(0, BLOCK_E)
    row_mask = row < rows
    mask = row_mask[:, None] & (column[None, :] < num_experts)
    offset = row[:, None].to(tl.int64) * num_experts + column[None, :]
    probs = tl.load(probs_ptr + offset, mask=mask, other=0.0).to(tl.float32)
    if HAS_GRAD_PROBS:
        g = tl.load(grad_probs_ptr + offset, mask=mask, other=0.0).to(tl.float32)
    else:
        g = tl.zeros([BLOCK_U, BLOCK_E], dtype=tl.float32)
    if HAS_GRAD_WEIGHTS:
        chosen = row.to(tl.int64) * top_k
        for j in range(top_k):
            expert = tl.load(experts_ptr + chosen + j, mask=row_mask, other=-1)
            grad_weight = tl.load(grad_weights_ptr + chosen + j, mask=row_mask, other=0.0).to(tl.float32)
            g += tl.where(column[None, :] == expert[:, None], grad_weight[:, None], 0.0)
    dot = tl.sum(g * probs, axis=1)
    grad = probs * (g - dot[:, None])
    tl.store(grad_logits_ptr + offset, grad.to(grad_logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _pairs_histogram_kernel(experts_ptr, histogram_ptr, choices, num_experts, BLOCK_P: tl.constexpr,
                            BLOCK_E: tl.constexpr):
    """histogram[b, e] (int32 [blocks, E]): how many of the choices b BLOCK_P ... (b + 1) BLOCK_P - 1 are expert e,
    BLOCK_E experts at a time."""
    block = tl.program_id(0)
    choice = block.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    expert = tl.load(experts_ptr + choice, mask=choice < choices, other=-1).to(tl.int32)
    for first in range(0, num_experts, BLOCK_E):
        column = first + tl.arange(0, BLOCK_E)
        count = tl.sum((expert[:, None] == column[None, :]).to(tl.int32), axis=0)
        tl.store(histogram_ptr + block.to(tl.int64) * num_experts + column, count, mask=column < num_experts)


@triton.jit
def _pairs_place_kernel(experts_ptr, weights_ptr, histogram_ptr, item_ptr, row_expert_ptr, pair_weights_ptr,
                        position_ptr, counts_ptr, ends_ptr, choices, num_experts, blocks, top_k,
                        BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """Each choice p of this block's BLOCK_P goes to position[p] = start[e] + before[e] + rank: e's segment start
    (the exclusive cumsum of the experts' totals), the earlier blocks' choices of e (their histograms), and its
    rank among this block's choices of e (a cumsum of their one-hot). The pair at that position gets item p // k,
    expert e and p's weight; program 0 writes the counts (int64) and the segments' ends (int32)."""
    block = tl.program_id(0)
    choice = block.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    choice_mask = choice < choices
    expert = tl.load(experts_ptr + choice, mask=choice_mask, other=-1).to(tl.int32)
    position = tl.zeros([BLOCK_P], dtype=tl.int32)
    start = 0
    for first in range(0, num_experts, BLOCK_E):
        column = first + tl.arange(0, BLOCK_E)
        column_mask = column < num_experts
        total = tl.zeros([BLOCK_E], dtype=tl.int32)
        before = tl.zeros([BLOCK_E], dtype=tl.int32)
        for first_block in range(0, blocks, BLOCK_B):
            other = first_block + tl.arange(0, BLOCK_B)
            counts = tl.load(histogram_ptr + other[:, None].to(tl.int64) * num_experts + column[None, :],
                             mask=(other[:, None] < blocks) & column_mask[None, :], other=0)
            total += tl.sum(counts, axis=0)
            before += tl.sum(tl.where(other[:, None] < block, counts, 0), axis=0)
        ends = start + tl.cumsum(total, axis=0)
        tl.store(counts_ptr + column, total.to(tl.int64), mask=column_mask & (block == 0))
        tl.store(ends_ptr + column, ends, mask=column_mask & (block == 0))
        one_hot = (expert[:, None] == column[None, :]).to(tl.int32)
        rank = tl.cumsum(one_hot, axis=0)  # 1 for a block's first choice of an expert
        slot = (ends - total + before - 1)[None, :] + rank
        position += tl.sum(tl.where(one_hot != 0, slot, 0), axis=1)
        start += tl.sum(total, axis=0)
    position = position.to(tl.int64)
    weight = tl.load(weights_ptr + choice, mask=choice_mask, other=0.0)
    tl.store(position_ptr + choice, position, mask=choice_mask)
    tl.store(item_ptr + position, choice // top_k, mask=choice_mask)
    tl.store(row_expert_ptr + position, expert.to(tl.int64), mask=choice_mask)
    tl.store(pair_weights_ptr + position, weight.to(tl.float32).to(pair_weights_ptr.dtype.element_ty),
             mask=choice_mask)


@triton.jit
def _choice_row(out_ptr, bias_ptr, experts_ptr, position, choice, item_mask, column, mask, stride_out, stride_bias,
                HAS_BIAS: tl.constexpr):
    """[BLOCK_T, BLOCK_C] fp32: out[position] of one choice of each item, plus bias[experts[choice]] with HAS_BIAS."""
    picked = tl.load(out_ptr + position[:, None] * stride_out + column[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        expert = tl.load(experts_ptr + choice, mask=item_mask, other=0)
        picked += tl.load(bias_ptr + expert[:, None] * stride_bias + column[None, :], mask=mask,
                          other=0.0).to(tl.float32)
    return picked


@triton.jit
def _combine_kernel(out_ptr, gates_ptr, position_ptr, experts_ptr, bias_ptr, y_ptr, items, columns, top_k,
                    stride_out, stride_bias, stride_y, HAS_GATES: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """y[t, c] = sum over j < k of gates[t, j] (out[position[t, j], c] + bias[experts[t, j], c]) in fp32 (gates
    and bias optional), over [BLOCK_T, BLOCK_C] tiles of y [items, columns]."""
    item = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    column = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    item_mask = item < items
    mask = item_mask[:, None] & (column[None, :] < columns)
    pair = item.to(tl.int64) * top_k
    y = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in range(top_k):
        position = tl.load(position_ptr + pair + j, mask=item_mask, other=0)
        picked = _choice_row(out_ptr, bias_ptr, experts_ptr, position, pair + j, item_mask, column, mask,
                             stride_out, stride_bias, HAS_BIAS)
        if HAS_GATES:
            picked *= tl.load(gates_ptr + pair + j, mask=item_mask, other=0.0).to(tl.float32)[:, None]
        y += picked
    tl.store(y_ptr + item[:, None].to(tl.int64) * stride_y + column[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _combine_backward_kernel(grad_ptr, out_ptr, gates_ptr, position_ptr, experts_ptr, bias_ptr, grad_out_ptr,
                             grad_gates_ptr, items, columns, top_k, stride_grad, stride_out, stride_bias,
                             stride_grad_out, HAS_BIAS: tl.constexpr, NEED_OUT: tl.constexpr,
                             NEED_GATES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    """grad_out[position[t, j]] = gates[t, j] grad[t] and grad_gates[t, j] = grad[t] . (out[position[t, j]] +
    bias[experts[t, j]]) of BLOCK_T items, sweeping the columns BLOCK_C at a time (the dot products complete in
    one program: no atomics)."""
    item = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    item_mask = item < items
    pair = item.to(tl.int64) * top_k
    slot = tl.arange(0, BLOCK_K)
    dots = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for first in range(0, columns, BLOCK_C):
        column = first + tl.arange(0, BLOCK_C)
        mask = item_mask[:, None] & (column[None, :] < columns)
        grad = tl.load(grad_ptr + item[:, None].to(tl.int64) * stride_grad + column[None, :], mask=mask,
                       other=0.0).to(tl.float32)
        for j in range(top_k):
            position = tl.load(position_ptr + pair + j, mask=item_mask, other=0)
            if NEED_OUT:
                gate = tl.load(gates_ptr + pair + j, mask=item_mask, other=0.0).to(tl.float32)
                tl.store(grad_out_ptr + position[:, None] * stride_grad_out + column[None, :],
                         (gate[:, None] * grad).to(grad_out_ptr.dtype.element_ty), mask=mask)
            if NEED_GATES:
                picked = _choice_row(out_ptr, bias_ptr, experts_ptr, position, pair + j, item_mask, column, mask,
                                     stride_out, stride_bias, HAS_BIAS)
                dots += tl.where(slot[None, :] == j, tl.sum(grad * picked, axis=1)[:, None], 0.0)
    if NEED_GATES:
        tl.store(grad_gates_ptr + pair[:, None] + slot[None, :], dots.to(grad_gates_ptr.dtype.element_ty),
                 mask=item_mask[:, None] & (slot[None, :] < top_k))


def launch_softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs fp32 [U, E], weights fp32 [U, k], experts int64 [U, k]): the softmax of logits [U, E] and its k
    largest per row, in descending order, the lowest expert first among equal probabilities."""
    logits = logits.contiguous()
    rows, num_experts = logits.shape
    probs = logits.new_empty(rows, num_experts, dtype=torch.float32)
    weights = logits.new_empty(rows, k, dtype=torch.float32)
    experts = logits.new_empty(rows, k, dtype=torch.int64)
    if rows:
        config = softmax_topk_config(num_experts)
        _softmax_topk_kernel[(triton.cdiv(rows, config["BLOCK_U"]),)](logits, probs, weights, experts, rows,
                                                                      num_experts, k, **config)
    return probs, weights, experts


def launch_softmax_topk_backward(grad_probs: torch.Tensor | None, grad_weights: torch.Tensor | None,
                                 probs: torch.Tensor, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad_logits [U, E] in `dtype` of `launch_softmax_topk`'s probs and weights, given their gradients (fp32
    [U, E] and [U, k], either None)."""
    probs, experts = probs.contiguous(), experts.contiguous()
    rows, num_experts = probs.shape
    grad_logits = probs.new_empty(rows, num_experts, dtype=dtype)
    if rows:
        config = softmax_topk_config(num_experts)
        has_probs, has_weights = grad_probs is not None, grad_weights is not None
        _softmax_topk_backward_kernel[(triton.cdiv(rows, config["BLOCK_U"]),)](
            grad_probs.contiguous() if has_probs else probs, grad_weights.contiguous() if has_weights else probs,
            probs, experts, grad_logits, rows, num_experts, experts.shape[1], HAS_GRAD_PROBS=has_probs,
            HAS_GRAD_WEIGHTS=has_weights, **config)
    return grad_logits


def launch_sort_pairs(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, dtype: torch.dtype):
    """(item, row_expert, pair_weights, counts, ends, position): the P = T k choices of experts [T, k] sorted
    stably by expert. item int64 [P] and row_expert int64 [P] are each pair's item and expert, pair_weights [P] its
    weight in `dtype`, counts int64 [E] the experts' pairs, ends int32 [E] their segments' ends, and position
    int64 [T, k] each choice's pair (the inverse of the sort). P < 2^31."""
    experts, weights = experts.contiguous(), weights.contiguous()
    items, top_k = experts.shape
    choices = items * top_k
    item = experts.new_empty(choices)
    row_expert = experts.new_empty(choices)
    pair_weights = weights.new_empty(choices, dtype=dtype)
    position = experts.new_empty(items, top_k)
    if not choices:
        counts = experts.new_zeros(num_experts)
        return item, row_expert, pair_weights, counts, counts.to(torch.int32), position
    counts = experts.new_empty(num_experts)
    ends = experts.new_empty(num_experts, dtype=torch.int32)
    config = dict(PAIRS_CONFIG)
    block_b = config.pop("BLOCK_B")
    blocks = triton.cdiv(choices, config["BLOCK_P"])
    histogram = experts.new_empty(blocks, num_experts, dtype=torch.int32)
    _pairs_histogram_kernel[(blocks,)](experts, histogram, choices, num_experts, **config)
    _pairs_place_kernel[(blocks,)](experts, weights, histogram, item, row_expert, pair_weights, position, counts,
                                   ends, choices, num_experts, blocks, top_k, BLOCK_B=block_b, **config)
    return item, row_expert, pair_weights, counts, ends, position


def launch_combine(out: torch.Tensor, gates: torch.Tensor | None, position: torch.Tensor,
                   experts: torch.Tensor | None, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """y [T, C] in `dtype`: sum over j of gates[t, j] (out[position[t, j]] + bias[experts[t, j]]), in fp32, of the
    pairs' outputs out [P, C]; without gates a plain sum, without bias (given only with gates and experts) none."""
    out, position = out.contiguous(), position.contiguous()
    items, top_k = position.shape
    columns = out.shape[1]
    y = out.new_empty(items, columns, dtype=dtype)
    if items and columns:
        has_gates, has_bias = gates is not None, bias is not None
        gates = gates.contiguous() if has_gates else out
        experts = experts.contiguous() if has_bias else position
        bias = bias.contiguous() if has_bias else out
        config = COMBINE_CONFIG
        grid = (triton.cdiv(items, config["BLOCK_T"]), triton.cdiv(columns, config["BLOCK_C"]))
        _combine_kernel[grid](out, gates, position, experts, bias, y, items, columns, top_k, out.stride(0),
                              bias.stride(0), y.stride(0), HAS_GATES=has_gates, HAS_BIAS=has_bias, **config)
    return y


def launch_combine_backward(grad: torch.Tensor, out: torch.Tensor, gates: torch.Tensor, position: torch.Tensor,
                            experts: torch.Tensor | None, bias: torch.Tensor | None, need_out: bool,
                            need_gates: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad_out [P, C] in out's dtype or None, grad_gates [T, k] in gates' dtype or None) of `launch_combine`
    with gates, given grad [T, C]: grad_out[position[t, j]] = gates[t, j] grad[t] and grad_gates[t, j] =
    grad[t] . (out[position[t, j]] + bias[experts[t, j]])."""
    grad, out, gates, position = grad.contiguous(), out.contiguous(), gates.contiguous(), position.contiguous()
    items, top_k = position.shape
    columns = out.shape[1]
    grad_out = torch.empty_like(out) if need_out else None
    grad_gates = torch.empty_like(gates) if need_gates else None
    if items and (need_out or need_gates):
        if not columns:
            return grad_out, grad_gates.zero_() if need_gates else None
        has_bias = bias is not None
        experts = experts.contiguous() if has_bias else position
        bias = bias.contiguous() if has_bias else out
        config = combine_backward_config(top_k)
        _combine_backward_kernel[(triton.cdiv(items, config["BLOCK_T"]),)](
            grad, out, gates, position, experts, bias, out if grad_out is None else grad_out,
            gates if grad_gates is None else grad_gates, items, columns, top_k, grad.stride(0), out.stride(0),
            bias.stride(0), columns, HAS_BIAS=has_bias, NEED_OUT=need_out, NEED_GATES=need_gates, **config)
    return grad_out, grad_gates

"""The autograd Functions behind the expert steps. Their backward writes each stacked parameter's gradient once,
in the parameter's own layout [E, ...] (on CPU into memory kept from one backward to the next,
`gradient_memory`), where plain autograd would copy a transposed gradient or allocate a full-size one per expert.
They take how the layer call runs as plain flags (`sync_free`, `traced`: the layer's `Mode`) and save them for
backward.

    ExpertLinear   every expert's linear map at once: padded (`bmm`) or jagged rows (`grouped.segment_mm`)
    GatherPairs    the items of the sorted (item, expert) pairs; backward by gathers, not a scatter-add
    CombinePairs   each item's k expert outputs, weighted and summed (with fc2's bias); backward by gathers
    SegmentGraphs  the loop step under autograd: a small graph per expert segment
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .gradient_memory import empty_gradient
from .grouped import segment_mm, segment_outer, segment_slices, segment_sum
from .pairs import combine
from .side_by_side import each_segment


class ExpertLinear(torch.autograd.Function):
    """Every expert's linear map at once, `x @ weight[e].T + bias[e]`, over a padded batch (x [E, M, C], two
    `bmm`s) or over jagged segments (x [S, C], `grouped.segment_mm` at `offsets`, `expert` [S] the expert of each row;
    with `dropped`, rows past the last offset give 0: `steps.rows.Segments`). `sync_free` and `traced`: the layer's
    `Mode` (on the sync-free path backward runs the grouped ops; on CPU eagerly one matmul per expert).

    Its backward writes the weight gradient in the weight's own layout [E, H, C], on CPU into memory kept from
    one backward to the next (`gradient_memory`: a fresh tensor that large is page-faulted in). Through plain autograd,
    `bmm(x, weight.transpose(1, 2))` yields a transposed gradient, which AccumulateGrad copies into the
    weight's layout: one more pass over every expert's weights per backward, as much as the matmuls for a
    few rows per expert. The output gradient is made dense first (torch's own grouped_mm backward refuses
    the stride-0 gradient of a `.sum()`).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, offsets, expert, dropped=False, sync_free=False, traced=False):
        ctx.save_for_backward(x, weight, offsets)
        ctx.has_bias, ctx.dropped, ctx.sync_free, ctx.traced = bias is not None, dropped, sync_free, traced
        if offsets is None:
            if bias is None:
                return torch.bmm(x, weight.transpose(1, 2))
            return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))
        y = segment_mm(x, weight, offsets, dropped=dropped, traced=traced)
        if bias is None:
            return y
        return y + (F.pad(bias, (0, 0, 0, 1)) if dropped else bias).index_select(0, expert)  # dropped: expert E

    @staticmethod
    def backward(ctx, grad):
        x, weight, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        x, weight = x.to(grad.dtype), weight.to(grad.dtype)  # autocast ran forward in grad's lower precision
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_x = grad_weight = grad_bias = None
        traced = ctx.traced
        if offsets is None:
            grad_x = torch.bmm(grad, weight) if need_x else None
            grad_weight = (torch.bmm(grad.transpose(1, 2), x, out=empty_gradient(weight, traced=traced))
                           if need_weight else None)
            grad_bias = grad.sum(1) if ctx.has_bias and need_bias else None
            return grad_x, grad_weight, grad_bias, None, None, None, None, None
        if need_x:
            grad_x = segment_mm(grad, weight, offsets, transpose=False, dropped=ctx.dropped, traced=traced)
        eager_cpu = not ctx.sync_free  # on CPU eagerly (`device_path()` runs the GPU's ops)
        if need_weight:
            grad_weight = (_weight_gradient_cpu(grad, x, offsets, weight) if eager_cpu
                           else segment_outer(grad, x, offsets, traced=traced))
        if ctx.has_bias and need_bias:
            if eager_cpu:  # one sum per segment: no scatter-add, whose cost explodes on a busy CPU
                grad_bias = grad.new_empty(weight.shape[:2])
                each_segment(lambda e, rows: torch.sum(grad[rows], 0, out=grad_bias[e]),  # no rows: zeros
                             segment_slices(offsets), grad.shape[1], device=grad.device)
            else:  # deterministic, and no atomics piling onto E rows as in index_add_ on a GPU
                grad_bias = segment_sum(grad, offsets, traced=traced)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


def _weight_gradient_cpu(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
                         weight: torch.Tensor) -> torch.Tensor:
    """[E, H, C] sum over each expert's rows of grad [S, H] x x [S, C], zero for experts without rows: one mm
    per expert into the gradient's kept memory (`empty_gradient`; grouped_mm has no out=, and its fresh tensor
    is page-faulted in at every step: docs/dispatch.md)."""
    out = empty_gradient(weight, traced=False)  # eagerly on CPU: never under a trace
    each_segment(lambda e, rows: torch.mm(grad[rows].t(), x[rows], out=out[e]),  # no rows: zeros
                 segment_slices(offsets), grad.shape[1], device=grad.device)
    return out


class GatherPairs(torch.autograd.Function):
    """rows [P, C] = items[item[r]] for the P = T * k sorted pairs. Backward sums each item's k row gradients by
    a gather at `position` [T, k] (where each item's choices sit among the pairs), where autograd's index_select
    backward scatter-adds with atomics (on a GPU, a bf16 atomic add per element: docs/dispatch.md has its cost at
    ViT-B width). On the sync-free path (`sync_free`, the layer's `Mode`) the sum is one op (`pairs.combine`)."""

    @staticmethod
    def forward(ctx, items, item, position, sync_free=False):
        ctx.save_for_backward(position)
        ctx.sync_free = sync_free
        return items.index_select(0, item)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (position,) = ctx.saved_tensors
        if ctx.sync_free:  # one op (one kernel on a GPU): each item's k rows summed
            return combine(grad, None, position, dtype=grad.dtype), None, None, None
        rows = grad.index_select(0, position.reshape(-1)).view(*position.shape, grad.shape[-1])
        return rows.sum(1) if position.shape[1] > 1 else rows.squeeze(1), None, None, None


class CombinePairs(torch.autograd.Function):
    """y[t] = sum over j < k of weights[t, j] * (out[position[t, j]] + bias[experts[t, j]]): each item's k
    expert outputs (rows of `out`, sorted by expert) weighted by their gates and summed, with the experts'
    output bias (None: none) folded in as gates @ bias. Every pass runs over [T, C'] or the gathered rows once;
    backward gathers at `order` [P] (the pair of each sorted row), never scatter-adds.

    Args:
        out: [P, C'] expert outputs of the sorted pairs; weights: [T, k] gate of each choice (0: dropped);
        position: [T, k] sorted row of each choice; order: [P] its inverse (row -> t * k + j);
        experts: [T, k] expert of each choice; bias: [E, C'] or None.
    """

    @staticmethod
    def forward(ctx, out, weights, position, order, experts, bias):
        tokens, k = weights.shape
        picked = out.index_select(0, position.reshape(-1)).view(tokens, k, out.shape[-1])
        dtype = torch.promote_types(out.dtype, weights.dtype)
        gates = None
        if bias is not None:  # sum_j w_j * bias[e_j] = gates @ bias, gates [T, E]
            gates = weights.new_zeros(tokens, bias.shape[0]).scatter_add_(1, experts, weights)
            y = torch.mm(gates.to(bias.dtype), bias).to(dtype)
        else:
            y = None
        for j in range(k):  # out of place: torch 2.11's compile got the gradients wrong after an in-place addcmul_
            choice, gate = picked[:, j], weights[:, j:j + 1]
            y = choice * gate if y is None else torch.addcmul(y, choice, gate)
        ctx.save_for_backward(picked, weights, order, experts, bias, gates)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        picked, weights, order, experts, bias, gates = ctx.saved_tensors
        need_out, need_weights = ctx.needs_input_grad[:2]
        grad_out = grad_weights = grad_bias = None
        low = grad.to(picked.dtype)  # under autocast, the fp32 residual stream's gradient; the rows are bf16
        if need_out:
            per_choice = low.unsqueeze(1) * weights.to(picked.dtype).unsqueeze(-1)  # [T, k, C']
            grad_out = per_choice.view(-1, picked.shape[-1]).index_select(0, order)
        if need_weights:  # one batched dot product per item: no [T, k, C'] temporary
            grad_weights = torch.bmm(picked, low.unsqueeze(-1)).squeeze(-1).to(weights.dtype)
            if bias is not None:
                grad_weights = grad_weights + (grad @ bias.to(grad.dtype).t()).gather(1, experts).to(weights.dtype)
        if bias is not None and ctx.needs_input_grad[5]:
            grad_bias = (gates.to(grad.dtype).t() @ grad).to(bias.dtype)
        return grad_out, grad_weights, None, None, None, grad_bias


class SegmentGraphs(torch.autograd.Function):
    """The loop step under autograd: expert e's whole FFN on its segment of rows, each segment a small autograd
    graph of its own whose leaves are the segment and expert e's slices of the parameters. Every intermediate
    is segment-sized, so it stays in cache and comes from malloc's heap; [S, H] tensors for all rows at once
    are mapped fresh at every step (page faults: docs/dispatch.md) and go through memory
    between ops. Backward runs each segment's graph and writes the parameter gradients into stacked tensors in
    the parameters' own layout (indexing `weight[e]` under autograd would allocate a full-size gradient per
    expert), zero for experts without rows.

    The segment graphs stay on this node until its backward, so they hold what autograd would have saved.
    A backward that keeps the graph (`retain_graph=True`) keeps them too.

    Args:
        x: [S, C] rows sorted by expert; ffn: ffn(rows, params of one expert, groups) -> [rows, C'], one expert's
        FFN (`Experts.ffn`); out_features: C'; hidden: H (the work per row); segments: rows per expert;
        groups: [S] image of each row or None; traced: the layer's `Mode.traced`; params: the stacked parameters.
    """

    @staticmethod
    def forward(ctx, x, ffn, out_features, hidden, segments, groups, traced, *params):
        needs = ctx.needs_input_grad
        out = x.new_empty(x.shape[0], out_features)
        ctx.rows, ctx.graphs, ctx.params = list(expert_segments(segments)), {}, params

        def segment(e, rows):  # on one thread, side by side with the other segments (`side_by_side`)
            leaves = [x[rows].detach().requires_grad_(needs[0])]
            leaves += [p[e].detach().requires_grad_(need) if p is not None else None
                       for p, need in zip(params, needs[7:], strict=True)]
            with torch.enable_grad():
                y = ffn(leaves[0], leaves[1:], groups[rows] if groups is not None else None)
            out[rows] = y.detach()
            y.untyped_storage().resize_(0)  # backward needs y's graph, not its values (fc2 and dropout keep none)
            ctx.graphs[e] = leaves, y

        each_segment(segment, ctx.rows, hidden, device=x.device)
        ctx.x_shape, ctx.segments, ctx.hidden, ctx.traced = x.shape, segments, hidden, traced
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        needs = ctx.needs_input_grad
        grads = [grad.new_empty(ctx.x_shape) if needs[0] else None]
        grads += [empty_gradient(p, traced=ctx.traced) if p is not None and need else None
                  for p, need in zip(ctx.params, needs[7:], strict=True)]
        keep = _keeps_graph()

        def segment(e, rows):  # on one thread, side by side with the other segments (`side_by_side`)
            leaves, y = ctx.graphs[e]
            wanted = [i for i, leaf in enumerate(leaves) if leaf is not None and leaf.requires_grad]
            got = torch.autograd.grad(y, [leaves[i] for i in wanted], grad[rows], retain_graph=keep,
                                      allow_unused=True)
            for i, g in zip(wanted, got, strict=True):
                target = grads[i][rows] if i == 0 else grads[i][e]
                if g is None:
                    target.zero_()
                else:
                    target.copy_(g)

        each_segment(segment, ctx.rows, ctx.hidden, device=grad.device)
        empty = [e for e, count in enumerate(ctx.segments) if not count]  # zero (filling all would cost a pass)
        for g in grads[1:]:
            if g is not None and empty:
                g[empty] = 0
        if not keep:
            ctx.graphs = None
        return (grads[0], None, None, None, None, None, None, *grads[1:])


def _keeps_graph() -> bool:
    """Whether the running backward keeps its graph (`retain_graph=True`): torch's own flag where this torch
    has it, else assume it does (correct, and frees the segment graphs with this node instead)."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return query() if query is not None else True


def expert_segments(segments: Sequence[int]):
    """(expert, row slice) of each non-empty segment of rows sorted by expert."""
    start = 0
    for e, count in enumerate(segments):
        if count:
            yield e, slice(start, start + count)
            start += count

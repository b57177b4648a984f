"""Routing and combine in a handful of ops (`layers/ops/pairs.py`):
- each op computes what the plain torch ops it replaces compute (softmax then top-k; the stable sort of the choices
  by expert; the weighted gather-sum with fc2's bias), and passes torch's opcheck (schema, fake, autograd);
- the gate gradient goes back by gathers: no `index_put`, no scatter-add, in forward or backward;
- along the GPU path (`device_path()`), a top-k layer runs at most 15 kernels in forward and 25 in forward+backward
  (tools/count_kernels.py: each moespec op counted as the kernels it launches on CUDA). (That the GPU path
  computes what the CPU path computes, outputs and every gradient, test_device_path.py checks for every layer.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from moespec.layers.ops import pairs
from moespec.layers.routing import inverse_permutation

TOOL = Path(__file__).resolve().parents[2] / "tools" / "count_kernels.py"


def _tool():
    spec = importlib.util.spec_from_file_location("moespec_count_kernels", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _logits(rows=37, experts=8, dtype=torch.float32):
    return torch.randn(rows, experts, generator=torch.Generator().manual_seed(0)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_softmax_topk_is_softmax_then_topk(k, dtype):
    logits = _logits(dtype=dtype).requires_grad_()
    probs, weights, experts = pairs.softmax_topk(logits, k)
    want = logits.detach().to(torch.promote_types(dtype, torch.float32)).requires_grad_()
    want_probs = want.softmax(-1)
    want_weights, want_experts = want_probs.topk(k, dim=-1)
    assert probs.dtype == want_probs.dtype and torch.equal(experts, want_experts)
    torch.testing.assert_close(probs, want_probs)
    torch.testing.assert_close(weights, want_weights)
    g_probs, g_weights = torch.randn_like(probs), torch.randn_like(weights)
    ((probs * g_probs).sum() + (weights * g_weights).sum()).backward()
    ((want_probs * g_probs).sum() + (want_weights * g_weights).sum()).backward()
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad, want.grad.to(dtype))


def test_sort_pairs_is_the_stable_sort_of_the_choices_by_expert():
    generator = torch.Generator().manual_seed(1)
    tokens, k, experts = 41, 2, 16
    choices = torch.randint(0, 5, (tokens, k), generator=generator)  # experts 5..15 empty
    weights = torch.rand(tokens, k, generator=generator, requires_grad=True)
    item, row_expert, pair_weights, counts, ends, position = pairs.sort_pairs(choices, weights, experts,
                                                                                   torch.bfloat16)
    order = torch.argsort(choices.reshape(-1), stable=True)
    assert torch.equal(item, order // k) and torch.equal(row_expert, choices.reshape(-1)[order])
    assert torch.equal(counts, torch.bincount(choices.reshape(-1), minlength=experts))
    assert ends.dtype == torch.int32 and torch.equal(ends, counts.cumsum(0).int())
    assert torch.equal(position, inverse_permutation(order).view(tokens, k))
    assert pair_weights.dtype == torch.bfloat16
    assert torch.equal(pair_weights, weights.detach().reshape(-1)[order].bfloat16())
    grad = torch.randn(tokens * k, generator=generator).bfloat16()
    pair_weights.backward(grad)
    torch.testing.assert_close(weights.grad, grad.float()[position])  # each choice's row's gradient


@pytest.mark.parametrize("bias", [False, True])
def test_combine_is_the_weighted_sum_of_each_items_rows(bias):
    generator = torch.Generator().manual_seed(2)
    tokens, k, experts, width = 23, 2, 4, 12
    choices = torch.randint(0, experts, (tokens, k), generator=generator)
    _, _, _, counts, ends, position = pairs.sort_pairs(choices, torch.ones(tokens, k), experts, torch.float32)
    out = torch.randn(tokens * k, width, generator=generator, requires_grad=True)
    gates = torch.rand(tokens, k, generator=generator, requires_grad=True)
    b = torch.randn(experts, width, generator=generator, requires_grad=True) if bias else None
    y = pairs.combine(out, gates, position, dtype=torch.float32, experts=choices, bias=b, ends=ends)
    want = sum(gates[:, j:j + 1] * (out[position[:, j]] + (b[choices[:, j]] if bias else 0)) for j in range(k))
    torch.testing.assert_close(y, want)
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, [out, gates] + ([b] if bias else []), grad)
    expected = torch.autograd.grad(want, [out, gates] + ([b] if bias else []), grad)
    for g, w in zip(got, expected, strict=True):
        torch.testing.assert_close(g, w)
    plain = pairs.combine(out, None, position, dtype=torch.float32)  # the gather's gradient: a plain sum
    torch.testing.assert_close(plain, out[position].sum(1))


def test_the_ops_pass_opcheck():
    generator = torch.Generator().manual_seed(3)
    tokens, k, experts, width = 13, 2, 4, 8
    logits = torch.randn(tokens, experts, generator=generator, requires_grad=True)
    torch.library.opcheck(torch.ops.moespec.softmax_topk.default, (logits, k))
    choices = torch.randint(0, experts, (tokens, k), generator=generator)
    weights = torch.rand(tokens, k, generator=generator, requires_grad=True)
    torch.library.opcheck(torch.ops.moespec.sort_pairs.default, (choices, weights, experts, torch.float32))
    _, _, _, _, ends, position = pairs.sort_pairs(choices, weights.detach(), experts, torch.float32)
    out = torch.randn(tokens * k, width, generator=generator, requires_grad=True)
    bias = torch.randn(experts, width, generator=generator, requires_grad=True)
    torch.library.opcheck(torch.ops.moespec.combine.default,
                          (out, weights, position, choices, bias, ends, torch.float32, False))


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_a_top_k_layer_runs_in_at_most_15_and_25_kernels(top_k, kind):
    """bf16 weights, the layer of issue 46's point 1: the gate's matmul, softmax + top-k, the pairs (two kernels),
    the gather, fc1, its bias and activation, fc2 and the combine; backward their gradients, with the bias
    gradients as grouped sums. No `index_put`, scatter or sort in backward."""
    tool = _tool()
    x = torch.randn(4, 25, 32, dtype=torch.bfloat16, requires_grad=True)
    forward, backward = tool.step_kernels(tool.layer(top_k, kind, torch.bfloat16), x, autocast=False)
    assert len(forward) <= 15 and len(forward) + len(backward) <= 25, (forward, backward)
    assert not [op for op in backward if "index_put" in op or "scatter" in op or "sort" in op], backward


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_under_autocast_the_extra_kernels_are_one_cast_per_weight(kind):
    """fp32 weights under bf16 autocast: besides the bf16 layer's kernels, one cast of each weight the step reads
    in bf16 and of the items in forward, and one cast of each gradient back in backward."""
    tool = _tool()
    bf16 = tool.step_kernels(tool.layer(2, kind, torch.bfloat16), torch.randn(100, 32, dtype=torch.bfloat16,
                                                                              requires_grad=True), autocast=False)
    layer = tool.layer(2, kind, torch.float32)
    fp32 = tool.step_kernels(layer, torch.randn(100, 32, requires_grad=True), autocast=True)
    cast = "aten._to_copy.default"
    for plain, cast_too in zip(bf16, fp32, strict=True):
        assert [op for op in cast_too if op != cast] == [op for op in plain if op != cast]
    cast_in_bf16 = [p for p in layer.parameters() if p is not layer.experts.fc1.bias]  # bias_act reads fp32
    assert fp32[0].count(cast) == len(cast_in_bf16) + 2  # and the items, twice: the gate's and the experts'
    assert fp32[1].count(cast) == len(list(layer.parameters())) + 2  # and the items' gradient, through both casts



def test_the_default_aux_loss_adds_its_own_ops_and_nothing_else():
    """A training step computes the layer's aux loss too (issue 62, point 2). The default, importance_load, is
    (CV(importance)^2 + CV(load)^2) / 2 times its weight. Counted by hand from that formula: forward, the
    importance's sum over items, the load's cast, per CV `var`, `mean`, `pow`, `add`, `div` (10), their sum and
    the halving, the weighting and the sum over kinds: 16. The routing and the experts run the same kernels as
    without the loss, and the loss's backward stays off the [T, E] probabilities but for its one broadcast."""
    tool = _tool()

    def items():  # a fresh leaf each time: a second backward into one would add its gradient accumulation
        return torch.randn(100, 32, dtype=torch.bfloat16, requires_grad=True)

    plain = tool.step_kernels(tool.layer(2, "gelu", torch.bfloat16), items(), autocast=False)
    with_loss = tool.step_kernels(tool.layer(2, "gelu", torch.bfloat16, losses="default"), items(), autocast=False)
    assert with_loss[0][:len(plain[0])] == plain[0]  # the layer's own kernels first, unchanged
    assert len(with_loss[0]) - len(plain[0]) == 16, with_loss[0][len(plain[0]):]
    assert len(with_loss[1]) - len(plain[1]) <= 16, with_loss[1]
    assert not [op for op in with_loss[1] if "index_put" in op or "scatter" in op or "sort" in op], with_loss[1]

"""The routing and combine kernels (`layers/kernels/pairs.py`), run in Triton's interpreter (a
subprocess with TRITON_INTERPRET=1, as in test_bias_act.py), compute what their torch definitions compute:

- softmax and top k: 1 to 300 experts, k up to 4, 0 or 1 rows and rows not multiples of the block, all-equal rows
  (the lowest experts first), fp32 / bf16 / fp16 logits; its backward with either gradient or both;
- the pairs sorted stably by expert: the integers exactly, with experts that get no choices, 0 choices, and
  several blocks of the kernels (the real blocks and small ones);
- the combine and its backward: widths not multiples of the column block, with and without gates and bias,
  bf16 / fp16 / fp32 outputs.
"""

from __future__ import annotations

import pytest
import torch

from .interpreter import interpreted, parent, run_interpreted

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.slow  # every pair kernel case in Triton's interpreter, in a subprocess (CI runs it)
@parent
def test_the_pair_kernels_in_the_interpreter():
    run_interpreted(__file__, timeout=600, select="interpreted")


def _kernels():
    from moespec.layers.kernels import pairs  # imports triton: only in the interpreted run

    return pairs


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """got == want in got's dtype: fp32 to 1e-5, a 16-bit output to 1e-2 of the fp32 reference cast to it."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if got.dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got, want, **tolerance)


def _softmax_topk(logits: torch.Tensor, k: int):
    """(probs, weights, experts) by torch: a stable descending sort, so that equal probabilities keep the lowest
    expert first (torch.topk's order among ties is unspecified)."""
    probs = logits.float().softmax(-1)
    experts = probs.argsort(dim=-1, descending=True, stable=True)[:, :k]
    return probs, probs.gather(1, experts), experts


def _logits(rows: int, experts: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[rows, E] random logits, every third row all equal (a tie of every expert)."""
    logits = torch.randn(rows, experts, generator=torch.Generator().manual_seed(seed)) * 3
    logits[::3] = 0.5
    return logits.to(dtype)


SOFTMAX_SHAPES = [(0, 8, 2), (1, 1, 1), (37, 8, 2), (70, 8, 4), (5, 128, 2), (9, 300, 4), (3, 300, 300)]


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, experts, k", SOFTMAX_SHAPES)
def test_softmax_topk_interpreted(rows, experts, k, dtype):
    logits = _logits(rows, experts, dtype)
    probs, weights, chosen = _kernels().launch_softmax_topk(logits, k)
    want_probs, want_weights, want_chosen = _softmax_topk(logits, k)
    _close(probs, want_probs)
    _close(weights, want_weights)
    assert chosen.dtype == torch.int64 and torch.equal(chosen, want_chosen)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("given", ["both", "probs", "weights"])
@pytest.mark.parametrize("rows, experts, k", SOFTMAX_SHAPES)
def test_softmax_topk_backward_interpreted(rows, experts, k, given, dtype):
    generator = torch.Generator().manual_seed(1)
    probs, _, chosen = _softmax_topk(_logits(rows, experts, torch.float32), k)
    chosen[:, -1] = chosen[:, 0]  # a repeated expert: both gradients add
    grad_probs = torch.randn(rows, experts, generator=generator) if given != "weights" else None
    grad_weights = torch.randn(rows, k, generator=generator) if given != "probs" else None
    g = torch.zeros(rows, experts).scatter_add(1, chosen, grad_weights if grad_weights is not None
                                               else torch.zeros(rows, k))
    g = g + (grad_probs if grad_probs is not None else 0)
    want = probs * (g - (g * probs).sum(-1, keepdim=True))
    got = _kernels().launch_softmax_topk_backward(grad_probs, grad_weights, probs, chosen, dtype)
    _close(got, want.to(dtype))


def _sort_pairs(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, dtype: torch.dtype):
    """The pairs by torch: a stable argsort of the flattened choices by expert."""
    items, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    position = torch.empty_like(order).scatter_(0, order, torch.arange(items * k)).view(items, k)
    return (order // k, flat[order], weights.reshape(-1)[order].to(dtype), counts,
            torch.cumsum(counts, 0).to(torch.int32), position)


def _choices(items: int, k: int, num_experts: int, used: int, seed: int = 0):
    """experts [T, k] drawn from `used` of the E experts (the others get none), fp32 weights [T, k]."""
    generator = torch.Generator().manual_seed(seed)
    kept = torch.randperm(num_experts, generator=generator)[:used]
    experts = kept[torch.randint(used, (items, k), generator=generator)]
    return experts, torch.rand(items, k, generator=generator)


SMALL_BLOCKS = {"BLOCK_P": 16, "BLOCK_E": 8, "BLOCK_B": 4, "num_warps": 4}


@interpreted
@pytest.mark.parametrize("blocks", ["real", "small"])
@pytest.mark.parametrize("items, k, num_experts, used", [(0, 2, 8, 8), (1, 1, 1, 1), (1, 2, 8, 1), (77, 2, 8, 3),
                                                         (45, 4, 128, 100), (50, 2, 300, 7), (150, 1, 300, 300)])
def test_sort_pairs_interpreted(items, k, num_experts, used, blocks, monkeypatch):
    """Small blocks (fp32 weights only, the interpreter being slow): up to 12 blocks of 16 choices, their histograms
    read 4 blocks at a time, 8 experts at a time."""
    kernels = _kernels()
    if blocks == "small":
        monkeypatch.setattr(kernels, "PAIRS_CONFIG", SMALL_BLOCKS)
    experts, weights = _choices(items, k, num_experts, used)
    for dtype in DTYPES if blocks == "real" else [torch.float32]:
        got = kernels.launch_sort_pairs(experts, weights, num_experts, dtype)
        want = _sort_pairs(experts, weights, num_experts, dtype)
        for name, g, w in zip(["item", "row_expert", "pair_weights", "counts", "ends", "position"], got, want,
                              strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
            if name == "pair_weights":  # the interpreter's cast to 16 bits may round otherwise than torch's
                _close(g, w)
            else:
                assert torch.equal(g, w), name


@interpreted
def test_sort_pairs_over_several_real_blocks_interpreted():
    """2,500 choices: 3 blocks of 1,024, every expert's segment across a block boundary."""
    experts, weights = _choices(1250, 2, 8, 5, seed=3)
    got = _kernels().launch_sort_pairs(experts, weights, 8, torch.float32)
    for g, w in zip(got, _sort_pairs(experts, weights, 8, torch.float32), strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def _combine_inputs(items: int, k: int, columns: int, num_experts: int, dtype: torch.dtype, seed: int = 0):
    """out [T k, C] in dtype, fp32 gates [T, k], position [T, k] (a permutation), experts [T, k], fp32 bias [E, C]."""
    generator = torch.Generator().manual_seed(seed)
    out = torch.randn(items * k, columns, generator=generator).to(dtype)
    gates = torch.rand(items, k, generator=generator)
    position = torch.randperm(items * k, generator=generator).view(items, k)
    experts = torch.randint(num_experts, (items, k), generator=generator)
    bias = torch.randn(num_experts, columns, generator=generator)
    return out, gates, position, experts, bias


def _picked(out, position, experts, bias):
    picked = out.float()[position]
    return picked + bias.float()[experts] if bias is not None else picked


COMBINE_SHAPES = [(0, 2, 24, 8), (1, 1, 24, 1), (45, 2, 200, 8), (33, 4, 24, 300)]


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("terms", ["plain", "gates", "gates-bias"])
@pytest.mark.parametrize("items, k, columns, num_experts", COMBINE_SHAPES)
def test_combine_interpreted(items, k, columns, num_experts, terms, dtype):
    out, gates, position, experts, bias = _combine_inputs(items, k, columns, num_experts, dtype)
    gates = gates if terms != "plain" else None
    experts, bias = (experts, bias) if terms == "gates-bias" else (None, None)
    picked = _picked(out, position, experts, bias)
    want = (picked * gates.float().unsqueeze(-1)).sum(1) if gates is not None else picked.sum(1)
    _close(_kernels().launch_combine(out, gates, position, experts, bias, dtype), want.to(dtype))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("need", ["both", "out", "gates"])
@pytest.mark.parametrize("items, k, columns, num_experts", COMBINE_SHAPES)
def test_combine_backward_interpreted(items, k, columns, num_experts, need, bias, dtype):
    out, gates, position, experts, bias_rows = _combine_inputs(items, k, columns, num_experts, dtype)
    experts, bias_rows = (experts, bias_rows) if bias else (None, None)
    grad = torch.randn(items, columns, generator=torch.Generator().manual_seed(4)).to(dtype)
    need_out, need_gates = need != "gates", need != "out"
    grad_out, grad_gates = _kernels().launch_combine_backward(grad, out, gates, position, experts, bias_rows,
                                                              need_out, need_gates)
    if need_out:
        want = torch.empty(items * k, columns)
        want[position.reshape(-1)] = (gates.unsqueeze(-1) * grad.float().unsqueeze(1)).reshape(-1, columns)
        _close(grad_out, want.to(dtype))
    else:
        assert grad_out is None
    if need_gates:
        want = (grad.float().unsqueeze(1) * _picked(out, position, experts, bias_rows)).sum(-1)
        _close(grad_gates, want.to(gates.dtype))
    else:
        assert grad_gates is None


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_a_layer_step_on_the_kernels_interpreted(kind, dtype, monkeypatch):
    """The pair ops and `bias_act` wired to the kernels (as on CUDA): a top-2 layer's step along the GPU path gives
    what it gives on the torch ops, output and every gradient (the launchers' argument and output orders, the
    dtypes)."""
    from torch import nn

    from moespec.layers import Experts, LinearGate, MoE, TopKRouter, device_path
    from moespec.layers.ops import backend

    from .test_device_path import _step

    torch.manual_seed(0)
    options = {"glu": "act_first", "bias": (False, False)} if kind == "swiglu" else {}
    bank = Experts(8, 16, 40, 16, act=nn.SiLU() if kind == "swiglu" else nn.GELU(), **options)
    layer = MoE(TopKRouter(LinearGate(16, 8), 8, 2), bank).to(dtype).train()
    for p in layer.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    x = torch.randn(3, 13, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    with device_path():
        want_y, want_grads = _step(layer, x)
        monkeypatch.setattr(backend, "on_device", lambda *tensors: True)
        y, grads = _step(layer, x)
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(y, want_y, **tolerance)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, **tolerance)


@interpreted
def test_softmax_topk_keeps_a_nan_rows_experts_in_range_interpreted():
    """A row of NaN logits (a diverged step) gives weights that are not finite but experts in [0, E): the pair
    kernels and the gathers after them index with them."""
    logits = _logits(5, 8, torch.float32)
    logits[2] = float("nan")
    _, weights, experts = _kernels().launch_softmax_topk(logits, 2)
    assert experts.min() >= 0 and experts.max() < 8
    assert not weights[2].isfinite().any() and weights[[0, 1, 3, 4]].isfinite().all()

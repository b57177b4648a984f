"""The forced triton expert step (`ops/scattered.py` over `kernels/scattered.py`) computes what the grouped_mm step
computes: outputs and the gradients of the input and of every parameter (fc1 / fc2 weights and biases, the
router's gate), with capacity drops (the tail), GELU and SwiGLU experts, k = 1 and 2, and compiled whole.

Without a GPU, Triton kernels run only in its interpreter, which reads TRITON_INTERPRET when the kernels are
defined, that is when moespec is imported. So `test_the_kernels_in_the_interpreter` runs this file again in a
subprocess with TRITON_INTERPRET=1, where the tests marked `interpreted` run (and skip in the parent). Without
the interpreter, the kernels are compiled for a Hopper GPU (no GPU needed: type and shape errors and shared memory
show there) and forcing the step on CPU says why it cannot run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from moespec.layers import device_path
from moespec.layers.experts import Experts
from moespec.layers.moe import MoE
from moespec.layers.ops import scattered
from moespec.layers.routers import ExpertChoiceRouter, ImageRouter, LinearGate, TopKRouter
from moespec.layers.steps import set_expert_step

from .interpreter import HAS_TRITON, INTERPRETED, interpreted, parent, run_interpreted
from .test_device_path import _step as outputs_and_gradients

DIM, HIDDEN, IMAGES, TOKENS = 32, 64, 3, 7
ROOT = Path(__file__).resolve().parents[2]


def _bank(experts: int, kind: str = "gelu", bias: bool = True) -> Experts:
    if kind == "swiglu":
        return Experts(experts, DIM, HIDDEN, DIM, act=nn.SiLU(), glu="act_first", bias=(False, False))
    if kind == "glu-last":
        return Experts(experts, DIM, HIDDEN // 2, DIM, act=nn.GELU(), glu="act_last")
    return Experts(experts, DIM, HIDDEN, DIM, act=nn.GELU(), bias=(bias, bias))


def _topk(experts: int, top_k: int, **options) -> TopKRouter:
    return TopKRouter(LinearGate(DIM, experts), experts, top_k, **options)


LAYERS = {
    "E4-k2-capacity": lambda: MoE(_topk(4, 2, capacity_factor=0.75), _bank(4)),
    "E2-k1-no-bias": lambda: MoE(_topk(2, 1), _bank(2, bias=False)),
    "E4-k1-capacity": lambda: MoE(_topk(4, 1, capacity_factor=0.5), _bank(4)),
    "E4-k2-swiglu-capacity": lambda: MoE(_topk(4, 2, capacity_factor=1.0), _bank(4, "swiglu")),
    "E2-k2-glu-act-last": lambda: MoE(_topk(2, 2), _bank(2, "glu-last")),
    "E4-k2-image": lambda: MoE(ImageRouter(LinearGate(DIM, 4), 4, 2), _bank(4)),
    "E4-expert-choice": lambda: MoE(ExpertChoiceRouter(LinearGate(DIM, 4), 4, capacity=1.5), _bank(4)),
}


def _layer(name: str) -> MoE:
    torch.manual_seed(0)
    layer = LAYERS[name]()
    for p in layer.parameters():  # away from the init's zeros and ones, so that every parameter matters
        p.data.add_(torch.randn_like(p) * 0.05)
    return layer.train()


def _inputs() -> torch.Tensor:
    return torch.randn(IMAGES, TOKENS, DIM, generator=torch.Generator().manual_seed(1))


def _step(layer: nn.Module, x: torch.Tensor, step: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and the gradients of the input and every parameter under expert step `step`, for a loss that
    weights each output."""
    experts = layer.experts if isinstance(layer, MoE) else layer._orig_mod.experts
    set_expert_step(experts, step)
    return outputs_and_gradients(layer, x)


def _assert_same(got, want, rtol=1e-4, atol=1e-5):
    y, grads = got
    y_want, grads_want = want
    torch.testing.assert_close(y, y_want, rtol=rtol, atol=atol)
    assert len(grads) == len(grads_want)
    for g, g_want in zip(grads, grads_want, strict=True):
        torch.testing.assert_close(g, g_want, rtol=rtol, atol=atol)


@pytest.mark.slow  # 2.5 min: every kernel case in Triton's interpreter, in a subprocess (CI runs it)
@parent
def test_the_kernels_in_the_interpreter():
    run_interpreted(__file__, timeout=900)


@interpreted
@pytest.mark.parametrize("weight_gradients", ["triton", "grouped_mm"])
@pytest.mark.parametrize("name", LAYERS)
def test_the_triton_step_computes_what_grouped_mm_computes(name, weight_gradients, monkeypatch):
    """On the sync-free path (a GPU's): top-k and image routing fuse the gather and the combine into the
    kernels (`position`); expert choice runs them on the gathered rows. The weight gradients either way: the
    Triton kernel that gathers its rows (fp32 on a GPU), torch's grouped GEMM on gathered rows (16 bits)."""
    monkeypatch.setattr(scattered, "WEIGHT_GRADIENTS", weight_gradients)
    layer, x = _layer(name), _inputs()
    with device_path():
        want = _step(layer, x, "grouped_mm")
        got = _step(layer, x, "triton")
    assert any(g.abs().max() > 0 for g in got[1])
    _assert_same(got, want)


@interpreted
@pytest.mark.parametrize("experts, kind, dtype", [(128, "gelu", torch.bfloat16), (16, "swiglu", torch.float16),
                                                  (16, "gelu", torch.float32)])
def test_many_experts_mostly_empty_and_widths_off_the_blocks(experts, kind, dtype):
    """Issue 46 point 2's shapes: up to E = 128 with 10 items (experts without rows), widths that are not
    multiples of the blocks (C = 24, H = 40 against 16 x 32 x 16 blocks), bf16 / fp16 / fp32 weights. (Each
    expert costs the kernels a row block whether or not it has rows: E = 128 takes a minute in the interpreter.)"""
    torch.manual_seed(0)
    dim, hidden = 24, 40
    options = {"glu": "act_first", "bias": (False, False)} if kind == "swiglu" else {}
    bank = Experts(experts, dim, hidden, dim, act=nn.SiLU() if kind == "swiglu" else nn.GELU(), **options)
    layer = MoE(TopKRouter(LinearGate(dim, experts), experts, 2), bank)
    for p in layer.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    layer = layer.to(dtype).train()
    x = torch.randn(2, 5, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    with device_path():
        want = _step(layer, x, "grouped_mm")
        got = _step(layer, x, "triton")
    assert (layer.last_routing.counts == 0).any()  # experts without rows
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    _assert_same(got, want, **tolerance)


@interpreted
@pytest.mark.parametrize("weight_gradients", ["triton", "grouped_mm"])
@pytest.mark.parametrize("name", ["E4-k2-capacity", "E2-k1-no-bias", "E4-k2-swiglu-capacity"])
def test_the_ops_give_what_their_fake_functions_promise(name, weight_gradients, monkeypatch):
    """Every output of the two custom ops has the shape, strides and dtype of its fake function's: torch.compile
    plans with the fake ones, and inductor asserts the strides of the real ones (a non-contiguous bias gradient
    failed there on the GPU)."""
    monkeypatch.setattr(scattered, "WEIGHT_GRADIENTS", weight_gradients)
    layer = _layer(name)
    seen = {}

    def spy(op, fake):
        def run(*args):
            outputs = op(*args)
            seen[op.__name__] = (outputs, fake(*args))
            return outputs
        return run

    monkeypatch.setattr(scattered, "scattered_ffn", spy(scattered._scattered_ffn, scattered._scattered_ffn_shape))
    monkeypatch.setattr(scattered, "scattered_ffn_backward", spy(scattered._scattered_ffn_backward,
                                                                 scattered._scattered_ffn_backward_shape))
    with device_path():
        _step(layer, _inputs(), "triton")
    assert set(seen) == {"_scattered_ffn", "_scattered_ffn_backward"}
    for op, (real, fake) in seen.items():
        for i, (r, f) in enumerate(zip(real, fake, strict=True)):
            assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype), (op, i)


@interpreted
def test_on_the_cpu_path_the_triton_step_computes_what_the_loop_computes():
    """Off the sync-free path (dropped pairs dropped, no `position`): the kernels on the gathered rows."""
    layer, x = _layer("E4-k2-capacity"), _inputs()
    _assert_same(_step(layer, x, "triton"), _step(layer, x, "loop"))


@interpreted
def test_the_tail_rows_give_zero_and_take_no_gradient():
    torch.manual_seed(0)
    bank = _bank(4)
    x = torch.randn(10, DIM, requires_grad=True)
    counts = torch.tensor([3, 0, 2, 1])  # 6 rows in segments, 4 in the tail
    set_expert_step(bank, "triton")
    y = bank(x, counts, dropped=True)
    assert y[6:].eq(0).all()
    set_expert_step(bank, "grouped_mm")
    torch.testing.assert_close(y[:6], bank(x[:6], counts), rtol=1e-5, atol=1e-6)
    y.sum().backward()
    assert x.grad[6:].eq(0).all()


@interpreted
def test_the_triton_step_compiles_whole():
    """fullgraph=True: the custom ops (with their fake functions) leave no graph break in forward or backward;
    aot_eager traces both with fake tensors and runs the kernels in the interpreter."""
    torch._dynamo.reset()
    layer, x = _layer("E4-k2-capacity"), _inputs()
    with device_path():
        want = _step(layer, x, "grouped_mm")
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    _assert_same(_step(compiled, x, "triton"), want)


@interpreted
def test_under_bf16_autocast_the_triton_step_agrees():
    """Autocast's dtype for the matmuls (bf16 rows and weights, fp32 accumulation), fp32 gradients for the
    fp32 parameters."""
    layer, x = _layer("E4-k2-capacity"), _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16), device_path():
        want = _step(layer, x, "grouped_mm")
        got = _step(layer, x, "triton")
    assert got[0].dtype == want[0].dtype
    assert [g.dtype for g in got[1]] == [g.dtype for g in want[1]]
    _assert_same(got, want, rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs on CPU")
def test_forcing_it_where_it_cannot_run_says_why():
    layer, x = _layer("E4-k2-capacity"), _inputs()
    set_expert_step(layer.experts, "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1" if HAS_TRITON else "triton is not installed"):
        layer(x)
    bank = Experts(2, DIM, HIDDEN, DIM, act=nn.GELU(approximate="tanh"), inner_norm="layernorm")
    set_expert_step(bank, "triton")
    with pytest.raises(RuntimeError, match=r"GELU \(exact\) or SiLU.*no inner norm"):
        bank(torch.randn(4, DIM), torch.tensor([2, 2]))


def _hopper_backend() -> bool:
    return HAS_TRITON and importlib.util.find_spec("triton.backends.nvidia") is not None


@pytest.mark.skipif(INTERPRETED or not _hopper_backend(), reason="compiles the kernels (not the interpreter's)")
def test_the_kernels_compile_for_a_hopper_gpu_without_spills():
    """What the interpreter does not check: each kernel as a real launch specializes it (its config in
    `kernels.scattered.CONFIGS`, its flags on and off, Triton's divisibility hints) builds for sm_90 within the
    shared memory an H100 / H200 has, and ptxas' report shows no register spilled, no GPU needed."""
    spec = importlib.util.spec_from_file_location("moespec_kernel_report", ROOT / "tools" / "kernel_report.py")
    report_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report_tool)
    for label, kernel, config, flags, integers in report_tool.launches():
        compiled = report_tool.compile_for_hopper(kernel, config, flags, integers)
        report = report_tool.ptxas_report(compiled)
        assert compiled.asm["cubin"], label
        assert report["shared"] <= 227 * 1024, (label, report)
        assert report["spill_stores"] == report["spill_loads"] == 0, (label, report)

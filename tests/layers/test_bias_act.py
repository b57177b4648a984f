"""fc1's bias and the activation in one op (`layers/ops/bias_act.py`): the grouped step on the
sync-free path runs fc1 without bias and then `moespec::bias_act`, and copies no weight bank per step.

- on `device_path()`, a top-k layer with GELU, SiLU and GLU experts gives the outputs and every gradient that the
  per-expert loop gives on the CPU path, in fp32 and under bf16 autocast, with a capacity's dropped rows and with
  experts that get no rows; activations and orders the op does not fuse take the plain ops;
- the profiler sees no `aten::cat` as large as the weight bank in forward and backward, and each fp32 expert
  weight cast once (forward), under autocast;
- the op's registrations (fake, autograd) pass `torch.library.opcheck`;
- the Triton kernels, run in Triton's interpreter (a subprocess with TRITON_INTERPRET=1, as in
  test_triton_step.py), compute what the torch implementation computes: widths not multiples of the blocks, up to
  128 experts with empty ones and dropped rows, fp32 / bf16 / fp16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from moespec.layers import device_path
from moespec.layers.experts import Experts
from moespec.layers.moe import MoE
from moespec.layers.ops import bias_act
from moespec.layers.routers import LinearGate, TopKRouter
from moespec.layers.steps import set_expert_step

from .interpreter import interpreted, parent, run_interpreted
from .test_device_path import _step as outputs_and_gradients

DIM, HIDDEN, IMAGES, TOKENS = 32, 64, 2, 5

KINDS = {  # bank options, and whether `bias_act` fuses its bias and activation
    "gelu": ({"act": nn.GELU()}, True),
    "silu": ({"act": nn.SiLU()}, True),
    "swiglu": ({"act": nn.SiLU(), "glu": "act_first"}, True),
    "glu-act-last": ({"act": nn.GELU(), "glu": "act_last"}, True),
    "gelu-tanh": ({"act": nn.GELU(approximate="tanh")}, False),
    "norm-before-act": ({"act": nn.GELU(), "inner_norm": "layernorm_before_act"}, False),
}
ROUTINGS = {  # experts, k, capacity factor: dropped rows; 16 experts for 10 items: experts without rows
    "E4-k2-capacity": (4, 2, 0.75),
    "E16-k2-empty-experts-capacity": (16, 2, 1.0),
    "E16-k1-empty-experts": (16, 1, None),
}


def _layer(kind: str, routing: str) -> MoE:
    torch.manual_seed(0)
    options, _ = KINDS[kind]
    experts, top_k, capacity = ROUTINGS[routing]
    hidden = HIDDEN // 2 if "glu" in options else HIDDEN
    router = TopKRouter(LinearGate(DIM, experts), experts, top_k,
                        **({} if capacity is None else {"capacity_factor": capacity}))
    layer = MoE(router, Experts(experts, DIM, hidden, DIM, **options))
    for p in layer.parameters():  # away from the init's zeros and ones, so that every parameter matters
        p.data.add_(torch.randn_like(p) * 0.05)
    return layer.train()


def _inputs() -> torch.Tensor:
    return torch.randn(IMAGES, TOKENS, DIM, generator=torch.Generator().manual_seed(1))


class OpCounts(TorchDispatchMode):
    """How often each of moespec's ops ran."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("moespec."):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_device_path_computes_what_the_per_expert_loop_computes(kind, routing, autocast):
    layer, x = _layer(kind, routing), _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        set_expert_step(layer.experts, "loop")
        y, grads = outputs_and_gradients(layer, x)
        set_expert_step(layer.experts, "auto")
        with device_path(), OpCounts() as ops:
            y_device, grads_device = outputs_and_gradients(layer, x)
    fused = KINDS[kind][1]
    assert ops.counts.get("moespec.bias_act.default", 0) == fused, ops.counts
    assert ops.counts.get("moespec.bias_act_backward.default", 0) == fused, ops.counts
    assert ops.counts.get("moespec.segment_mm.default", 0) >= 2, ops.counts  # the grouped step ran
    tolerance = {"rtol": 5e-2, "atol": 5e-2} if autocast else {"rtol": 1e-4, "atol": 1e-5}
    assert y_device.dtype == y.dtype
    torch.testing.assert_close(y_device, y, **tolerance)
    for got, want in zip(grads_device, grads, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **tolerance)


def _bank_events(kind: str):
    """(forward events, backward events, fc1's weight, fc2's weight) of a top-k layer's step on `device_path()`
    under bf16 autocast with fp32 weights, profiled with shapes and memory."""
    layer, x = _layer(kind, "E4-k2-capacity"), _inputs().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16), device_path():
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as forward:
            y = layer(x)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as backward:
            y.float().square().sum().backward()
    return forward.events(), backward.events(), layer.experts.fc1.weight, layer.experts.fc2.weight


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_no_copy_of_the_weight_bank_per_step(kind):
    """No `aten::cat` allocates as much as a bank in bf16 (the bias column's [E, H, C + 8] did), and each fp32
    weight bank goes through one `_to_copy` of its shape: its cast to bf16, in forward. The backward's one
    `_to_copy` of a bank's shape is its gradient's, bf16 to the fp32 parameter's dtype (autograd's, of the cast)."""
    forward, backward, w1, w2 = _bank_events(kind)
    bank_bytes = min(w1.numel(), w2.numel()) * 2
    for events in (forward, backward):
        cats = [e.cpu_memory_usage for e in events if e.name == "aten::cat"]
        assert all(size < bank_bytes for size in cats), (cats, bank_bytes)
    for weight in (w1, w2):
        shape = list(weight.shape)
        casts = [e for e in forward if e.name == "aten::_to_copy" and e.input_shapes[:1] == [shape]]
        assert [e.input_dtypes[0] for e in casts] == ["float"], [(e.input_dtypes, e.input_shapes) for e in casts]
        back = [e for e in backward if e.name == "aten::_to_copy" and e.input_shapes[:1] == [shape]]
        assert [e.input_dtypes[0] for e in back] == ["c10::BFloat16"], [e.input_dtypes for e in back]


def _op_inputs(rows: int, hidden: int, experts: int, glu: int, dtype: torch.dtype, seed: int = 0):
    """pre [rows, H'], bias [E, H'] (fp32), expert [rows] sorted (E for a dropped tail; some experts empty),
    offsets int32 [E]."""
    generator = torch.Generator().manual_seed(seed)
    wide = hidden * (2 if glu else 1)
    pre = torch.randn(rows, wide, generator=generator).to(dtype)
    bias = torch.randn(experts, wide, generator=generator)
    used = torch.randperm(experts, generator=generator)[:max(1, experts // 3)]  # the other experts: no rows
    kept = rows - rows // 5
    expert = used[torch.randint(len(used), (kept,), generator=generator)].sort().values
    expert = torch.cat([expert, torch.full((rows - kept,), experts)])
    offsets = torch.bincount(expert, minlength=experts + 1)[:experts].cumsum(0).to(torch.int32)
    return pre, bias, expert, offsets


@pytest.mark.parametrize("glu", [None, "act_first", "act_last"])
@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_the_op_passes_opcheck(act, glu):
    pre, bias, expert, offsets = _op_inputs(11, 8, 4, bias_act.GLU_ORDERS.index(glu), torch.float32)
    args = (pre.requires_grad_(), bias.requires_grad_(), expert, offsets, bias_act.ACTIVATIONS.index(act),
            bias_act.GLU_ORDERS.index(glu), False)
    torch.library.opcheck(torch.ops.moespec.bias_act.default, args)


@pytest.mark.parametrize("glu", [None, "act_first"])
def test_without_a_bias_it_is_the_activation_alone(glu):
    """A bank without fc1 bias (SwiGLU experts) runs `bias_act` too: the activation (and the gating) in one op."""
    pre, _, expert, offsets = _op_inputs(11, 8, 4, bias_act.GLU_ORDERS.index(glu), torch.float32)
    pre.requires_grad_()
    h = bias_act.bias_act(pre, None, expert, offsets, act="silu", glu=glu)
    a, b = pre.chunk(2, dim=-1) if glu else (pre, None)
    want = F.silu(a) * b if glu else F.silu(a)
    torch.testing.assert_close(h, want)
    grad = torch.randn_like(h)
    torch.testing.assert_close(torch.autograd.grad(h, pre, grad)[0], torch.autograd.grad(want, pre, grad)[0])
    args = (pre, None, expert, offsets, bias_act.ACTIVATIONS.index("silu"), bias_act.GLU_ORDERS.index(glu), False)
    torch.library.opcheck(torch.ops.moespec.bias_act.default, args)


@pytest.mark.slow  # 9 s: every kernel case in Triton's interpreter, in a subprocess (CI runs it)
@parent
def test_the_kernels_in_the_interpreter():
    run_interpreted(__file__, timeout=240, select="kernel")


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("glu", [0, 1, 2])
@pytest.mark.parametrize("act", [0, 1])
@pytest.mark.parametrize("rows, hidden, experts", [(45, 150, 5), (70, 33, 128), (1, 7, 1)])
def test_the_kernel_computes_what_the_torch_ops_compute(rows, hidden, experts, act, glu, dtype):
    """Row and column counts that are not multiples of the blocks (32 x 128), E up to 128 with most experts
    empty, and a dropped tail (expert E: no bias)."""
    pre, bias, expert, offsets = _op_inputs(rows, hidden, experts, glu, dtype)
    grad = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    tolerance = {} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    from moespec.layers.kernels import bias_act as kernels  # imports triton: only in the interpreted run

    h = kernels.launch(pre, bias, expert, act, glu)
    assert h.dtype == dtype and h.shape == (rows, hidden)
    torch.testing.assert_close(h, bias_act._torch_forward(pre, bias, expert, act, glu), **tolerance)
    dpre = kernels.launch_backward(grad, pre, bias, expert, act, glu)
    torch.testing.assert_close(dpre, bias_act._torch_backward(grad, pre, bias, expert, act, glu), **tolerance)
    if act == 1 and rows == 45:  # without a bias (SwiGLU experts): the kernels read none
        torch.testing.assert_close(kernels.launch(pre, None, expert, act, glu),
                                   bias_act._torch_forward(pre, None, expert, act, glu), **tolerance)
        torch.testing.assert_close(kernels.launch_backward(grad, pre, None, expert, act, glu),
                                   bias_act._torch_backward(grad, pre, None, expert, act, glu), **tolerance)

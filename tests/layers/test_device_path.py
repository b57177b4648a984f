"""The GPU path, seen on CPU (issue 35, points 4 and 5): static shapes, no host sync, the grouped step.

`dispatch.device_path()` makes the CPU take the path every other device takes (`dispatch.sync_free`). On it:
- every layer kind computes what the CPU path computes, outputs and every gradient;
- no op that waits for the device runs (`SyncProbe`, a dispatch mode), and torch.compile captures the layer's
  forward and backward whole (`fullgraph=True`): an `.item()`, a `.tolist()` or a data-dependent shape would
  break the graph;
- a capacity's dropped pairs stay after the experts' segments with weight 0 (`Routing.dropped`), and every step
  gives 0 for them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from moespec.layers import device_path
from moespec.layers.experts import Experts
from moespec.layers.moe import MoE
from moespec.layers.routers import ExpertChoiceRouter, ImageRouter, LinearGate, TopKRouter
from moespec.layers.soft import SoftMoE
from moespec.layers.steps import available_steps, set_expert_step

DIM, HIDDEN, EXPERTS, IMAGES, TOKENS = 32, 64, 4, 4, 9


def _bank(kind: str = "gelu", experts: int = EXPERTS) -> Experts:
    options = {"gelu": {}, "swiglu": {"glu": "act_first", "bias": (False, False)},
               "norm": {"inner_norm": "layernorm"}, "grn": {"inner_norm": "grn"},
               "clamped-glu": {"glu": "act_first", "clamped": True}}[kind]
    act = nn.SiLU() if kind == "swiglu" else nn.GELU()
    bank = Experts(experts, DIM, HIDDEN, DIM, act=act, **options)
    if bank.clamp is not None:  # Gemma 4's bounds: fc1's two halves and fc2 each clamp input and output
        bank.clamp.copy_(torch.tensor([[-1.0, 1.2, -0.02, 0.03], [-1.5, 0.8, -0.03, 0.02], [-0.2, 0.3, -1e-3, 1e-3]]))
    return bank


def _topk(**options) -> TopKRouter:
    return TopKRouter(LinearGate(DIM, EXPERTS), EXPERTS, options.pop("top_k", 2), **options)


LAYERS = {
    "topk2": lambda: MoE(_topk(), _bank()),
    "topk1-swiglu": lambda: MoE(_topk(top_k=1), _bank("swiglu")),
    "topk2-clamped-glu": lambda: MoE(_topk(), _bank("clamped-glu")),
    "topk-capacity": lambda: MoE(_topk(capacity_factor=0.75), _bank()),
    "topk-bpr-drop-norm": lambda: MoE(_topk(capacity_factor=1.0, bpr=True, drop_fraction=0.25), _bank("norm")),
    "topk-capacity-batch-group": lambda: MoE(_topk(top_k=1, capacity_factor=0.5, group=None), _bank()),
    "topk-shared": lambda: MoE(_topk(noise_std=0.0), _bank(), _bank(experts=1)),
    "image": lambda: MoE(ImageRouter(LinearGate(DIM, EXPERTS), EXPERTS, 2), _bank()),
    "expert_choice": lambda: MoE(ExpertChoiceRouter(LinearGate(DIM, EXPERTS), EXPERTS, capacity=1.5), _bank()),
    "soft": lambda: SoftMoE(_bank(), slots_per_expert=2),
}
GRN = {"topk-capacity-grn": lambda: MoE(_topk(capacity_factor=0.75), _bank("grn"))}  # the loop: it syncs


def _layer(name: str) -> nn.Module:
    torch.manual_seed(0)
    layer = {**LAYERS, **GRN}[name]()
    for p in layer.parameters():  # away from the init's zeros and ones, so that every parameter matters
        p.data.add_(torch.randn_like(p) * 0.05)
    return layer.train()


def _inputs() -> torch.Tensor:
    return torch.randn(IMAGES, TOKENS, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)


def _step(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and the gradients of the input and every parameter, for a loss that weights each output."""
    layer.zero_grad()
    x = x.detach().requires_grad_()
    y = layer(x)
    weights = torch.linspace(-1, 1, y.numel()).view_as(y)
    loss = (y * weights).sum() + sum(getattr(layer, "aux_losses", {}).values(), torch.zeros(()))
    loss.backward()
    return y.detach(), [x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("name", [*LAYERS, *GRN])
def test_the_device_path_computes_what_the_cpu_path_computes(name):
    layer, x = _layer(name), _inputs()
    y, grads = _step(layer, x)
    with device_path():
        y_device, grads_device = _step(layer, x)
    torch.testing.assert_close(y_device, y, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads_device, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


class SyncProbe(TorchDispatchMode):
    """Records the ops of a call that would wait for a GPU: reading a value on the host (`.item()`, `int()`),
    a tensor made from host data (a copy to the device), a boolean mask index or nonzero (an output shape that
    depends on the data), a repeat_interleave without its output size. (`.tolist()` does not dispatch: the
    fullgraph compile below catches it.)"""

    SYNCING = {"aten._local_scalar_dense.default", "aten.lift_fresh.default", "aten.nonzero.default",
               "aten.masked_select.default", "aten._unique2.default", "aten.unique_consecutive.default",
               "aten.bincount.default"}

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        self.ops += 1
        masks = [a for a in (args[1] if name.startswith(("aten.index.", "aten.index_put")) else ())
                 if isinstance(a, torch.Tensor) and a.dtype == torch.bool]
        unsized = name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None and len(args) < 3
        if name in self.SYNCING or masks or unsized:
            self.syncs.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", LAYERS)
def test_the_device_path_has_no_host_sync(name):
    layer, x = _layer(name), _inputs()
    with device_path(), SyncProbe() as probe:
        y = layer(x)
        y.sum().backward()
    assert probe.syncs == [], f"{name}: ops that wait for the device: {probe.syncs}"


@pytest.mark.parametrize("name", LAYERS)
def test_every_layer_kind_compiles_whole_forward_and_backward(name):
    """fullgraph=True: torch.compile refuses a graph break (a host sync, a data-dependent shape). aot_eager
    runs AOTAutograd's fake-tensor trace of forward and backward (the custom ops' fake functions included),
    without inductor's C++ build; tests/compiler/test_torch_compile.py runs inductor."""
    torch._dynamo.reset()
    layer, x = _layer(name), _inputs()
    y, grads = _step(layer, x)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    y_compiled, grads_compiled = _step(compiled, x)
    torch.testing.assert_close(y_compiled, y, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads_compiled, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("step", available_steps())
def test_every_step_gives_zero_for_the_tail_rows(step):
    """Rows past sum(counts) (the pairs a capacity dropped, kept by the sync-free routing) give 0, and no
    gradient flows through them."""
    torch.manual_seed(0)
    bank = _bank("norm")
    set_expert_step(bank, step)
    x = torch.randn(10, DIM, requires_grad=True)
    counts = torch.tensor([3, 0, 2, 1])  # 6 rows in segments, 4 in the tail
    y = bank(x, counts, dropped=True)
    assert y[6:].eq(0).all()
    torch.testing.assert_close(y[:6], bank(x[:6], counts), rtol=1e-5, atol=1e-6)
    y.sum().backward()
    assert x.grad[6:].eq(0).all()


def test_dropped_pairs_follow_the_segments_with_weight_zero():
    layer = _layer("topk-capacity")
    items = _inputs().detach().reshape(-1, DIM)
    with device_path():
        routing = layer.router(items, IMAGES)
    host = layer.router(items, IMAGES)
    kept = int(routing.counts.sum())
    assert routing.dropped and routing.item.numel() == items.shape[0] * 2 > kept  # every choice stays
    assert routing.weights[kept:].eq(0).all()
    for name in ("item", "weights", "counts", "position"):  # the same rows on the host's path
        torch.testing.assert_close(getattr(routing, name), getattr(host, name))
    torch.testing.assert_close(routing.kept, host.kept)


class OpDtypes(TorchDispatchMode):
    """The dtypes of the tensors going into moespec's grouped matmul ops (not `bias_act`, which reads fc1's fp32
    bias as it is)."""

    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("moespec.segment_"):
            self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["topk2", "topk-capacity", "topk1-swiglu"])
def test_under_bf16_autocast_the_device_path_runs_the_experts_in_bf16_and_agrees(name):
    """Autocast does not cast a custom op's inputs: the grouped step casts the rows and weights itself, as
    F.linear under autocast would (on a GPU, the bf16 kernels), and gives what the CPU path gives."""
    layer, x = _layer(name), _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, grads = _step(layer, x)
        with device_path(), OpDtypes() as seen:
            y_device, grads_device = _step(layer, x)
    assert seen.dtypes and seen.dtypes <= {torch.bfloat16}, seen.dtypes  # every grouped matmul, fwd and bwd
    assert y_device.dtype == y.dtype
    torch.testing.assert_close(y_device, y, rtol=2e-2, atol=2e-2)
    for got, want in zip(grads_device, grads, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)

"""torch.compile of a training model (issue 35, point 4): compiled steps called alternately with eager steps of
the same model, with `moespec.aux_loss` in the loss, give the eager losses, in fp32 and under bf16 autocast.
While torch.compile traces, the layers take the sync-free path (`dispatch.sync_free`): the grouped step runs
moespec's custom ops, whose fake functions take every dtype (torch's grouped_mm's took only bf16 / fp16, and
the first fp32 step stopped in inductor's fake-tensor run). tests/layers/test_device_path.py compiles each
layer kind whole (fullgraph=True)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moespec
from moespec.layers.ops.mode import exporting

from ..conftest import make_spec

TINY = {"model": "vit_small_patch16_224",
        "kwargs": {"depth": 2, "embed_dim": 64, "num_heads": 2, "img_size": 32, "num_classes": 10}}
ROUTERS = {"topk2": {"top_k": 2}, "topk_capacity": {"top_k": 1, "capacity_factor": 1.25},
           "image": {"kind": "image"}, "expert_choice": {"kind": "expert_choice"}, "soft": {"kind": "soft"}}


def _losses(router: dict, compiled: bool, autocast: bool, steps: int = 4) -> list[float]:
    spec = make_spec(TINY, [{"where": {"every": 1}, "experts": 4, "router": router}], input_size=[3, 32, 32])
    model = moespec.create_model(spec, seed=0)
    step_model = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32, generator=generator), torch.randint(0, 10, (4,), generator=generator)
    losses = []
    for step in range(steps):
        run = step_model if step % 2 == 0 else model  # compiled, eager, compiled, eager
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(run(x), y) + moespec.aux_loss(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("router", ROUTERS, ids=str)
def test_compiled_and_eager_steps_alternate_with_the_aux_loss_and_match_eager(router):
    torch._dynamo.reset()
    eager = _losses(ROUTERS[router], compiled=False, autocast=False)
    assert _losses(ROUTERS[router], compiled=True, autocast=False) == pytest.approx(eager, rel=1e-4, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("router", ["topk2", "image"])
def test_compiled_training_under_bf16_autocast_matches_eager(router):
    torch._dynamo.reset()
    eager = _losses(ROUTERS[router], compiled=False, autocast=True)
    assert _losses(ROUTERS[router], compiled=True, autocast=True) == pytest.approx(eager, rel=2e-2)


def test_exporting_is_true_under_torch_export_only():
    """The MoE layers take their export path (static pairs, every expert on every item, no routing state) only
    under torch.export. torch 2.11's Dynamo answered `torch.compiler.is_exporting()` with True under
    torch.compile too: the layers then ran the export path and left `moespec.aux_loss` an eager step's losses
    ("backward through the graph a second time" on the next compiled step)."""

    class Probe(torch.nn.Module):
        def forward(self, x):
            return x + 1 if exporting() else x - 1

    probe, x = Probe(), torch.zeros(1)
    assert probe(x).item() == -1
    assert torch.compile(probe, backend="eager")(x).item() == -1
    assert torch.export.export(probe, (x,)).module()(x).item() == 1


@pytest.mark.parametrize("router", ["topk2", "expert_choice"])
def test_compiled_eval_and_training_step_break_no_graph_and_warn_nothing(router, recwarn):
    """What a user sees of `torch.compile(model)`: an eval forward, then a training step at batch 2, with no
    graph break and no warning (a `Tensor.item()` in the expert step's choice broke the graph in eval and
    printed a long stack; a training step at batch 2 crashed)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    spec = make_spec(TINY, [{"where": {"every": 1}, "experts": 4, "router": ROUTERS[router]}], input_size=[3, 32, 32])
    model = moespec.create_model(spec, seed=0)
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        eager = model.eval()(torch.ones(2, 3, 32, 32))
        torch.testing.assert_close(compiled(torch.ones(2, 3, 32, 32)), eager)
    model.train()
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    loss = F.cross_entropy(compiled(x), y) + moespec.aux_loss(model)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not [str(w.message) for w in recwarn]


def _compiled_layer_step(autocast: bool, backend) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and gradients of a top-2 GELU layer's training step (fp32 weights; under bf16 autocast or not),
    its layer compiled with `backend`."""
    from torch import nn

    from moespec.layers.experts import Experts
    from moespec.layers.moe import MoE
    from moespec.layers.routers import LinearGate, TopKRouter

    torch.manual_seed(0)
    layer = MoE(TopKRouter(LinearGate(32, 4), 4, 2), Experts(4, 32, 64, 32, act=nn.GELU())).train()
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    run = layer if backend is None else torch.compile(layer, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = run(x)
    y.float().square().sum().backward()
    return y.detach(), [x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-autocast", "fp32"])
def test_under_compile_the_bf16_grouped_matmuls_are_visible_to_inductor(autocast):
    """Issue 46, point 6: in bf16 the traced forward and backward graphs hold `aten._grouped_mm` itself, which
    inductor tunes and fuses around, and no opaque `moespec.segment_*` op; in fp32 (whose `_grouped_mm` has no
    fake kernel in torch <= 2.11) the custom ops stay. The graphs are recorded by an AOTAutograd backend;
    inductor itself then compiles the bf16 step on CPU and gives what the eager step gives."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(graph, example_inputs):
        graphs.append(graph.code)
        return make_boxed_func(graph.forward)

    torch._dynamo.reset()
    _compiled_layer_step(autocast, aot_autograd(fw_compiler=record, bw_compiler=record))
    assert len(graphs) == 2  # forward and backward
    for code in graphs:
        if autocast:
            assert "aten._grouped_mm" in code and "moespec.segment_" not in code
        else:
            assert "moespec.segment_mm" in code and "_grouped_mm" not in code
    if autocast:
        torch._dynamo.reset()
        y, grads = _compiled_layer_step(True, "inductor")
        y_eager, grads_eager = _compiled_layer_step(True, None)
        torch.testing.assert_close(y, y_eager, rtol=5e-2, atol=5e-2)
        for got, want in zip(grads, grads_eager, strict=True):
            torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)

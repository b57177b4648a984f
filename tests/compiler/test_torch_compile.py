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
from moespec.layers.dispatch import exporting

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

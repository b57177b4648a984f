"""Export: an eval-mode model with any router exports with torch.export and with torch.onnx (dynamo) and
computes what the eager model computes. While exporting, the MoE layer runs every expert on every item and
combines with the routing weights, so that no shape depends on the data (`MoE._dense_combine`)."""

from __future__ import annotations

import pytest
import torch

import moespec

from ..conftest import TINY_CONVNEXT, TINY_INPUT, TINY_VIT, make_spec, quick_first

ROUTERS = {
    "topk": {"experts": 4, "top_k": 2},
    "topk-capacity": {"experts": 4, "top_k": 2, "capacity_factor": 1.0},
    "topk-bpr": {"experts": 4, "top_k": 1, "capacity_factor": 0.5, "router": {"kind": "topk", "bpr": True}},
    "topk-drop": {"experts": 4, "top_k": 2, "router": {"kind": "topk", "drop_fraction": 0.25}},
    "topk-shared-cosine": {"experts": 4, "top_k": 1, "shared_experts": 1,
                           "router": {"kind": "topk", "gate": {"kind": "cosine"}}},
    "expert_choice": {"experts": 4, "router": {"kind": "expert_choice"}},
    "image": {"experts": 4, "top_k": 2, "router": {"kind": "image"}},
    "soft": {"experts": 4, "router": {"kind": "soft"}},
}


def _model(backbone: dict, group: dict) -> torch.nn.Module:
    return moespec.create_model(make_spec(backbone, [{"where": {"every": 1}, **group}]), seed=0).eval()


# every router on token sequences; on ConvNeXt's feature maps (channels first and last) the token routers
CASES = [(TINY_VIT, router) for router in ROUTERS] + [(TINY_CONVNEXT, router) for router in
                                                     ("topk", "topk-capacity", "expert_choice")]
IDS = [f"{b['model'].split('_')[0]}-{r}" for b, r in CASES]
# the quick run: each kind of router once (top-k, expert choice, image, soft) and ConvNeXt's feature maps once; the
# top-k options (capacity, BPR, drops, a shared expert and a cosine gate) export the same way, and CI runs them
QUICK = {"vit-topk", "vit-expert_choice", "vit-image", "vit-soft", "convnext-topk"}


@pytest.mark.parametrize("backbone,router", quick_first(CASES, QUICK, IDS))
def test_torch_export_matches_eager(backbone, router):
    model = _model(backbone, ROUTERS[router])
    exported = torch.export.export(model, (torch.randn(2, *TINY_INPUT),))
    assert all(layer.last_items == 0 for layer in moespec.moe_layers(model).values())  # export left no state
    x = torch.randn(2, *TINY_INPUT)  # not the tracing input: the routing differs
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(x), model(x), atol=1e-5, rtol=0)


@pytest.mark.slow  # the ONNX conversion takes seconds per model
@pytest.mark.parametrize("router", ROUTERS)
def test_onnx_export_matches_eager(router, tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    model = _model(TINY_VIT, ROUTERS[router])
    path = tmp_path / "model.onnx"
    torch.onnx.export(model, (torch.randn(2, *TINY_INPUT),), str(path), dynamo=True)
    x = torch.randn(2, *TINY_INPUT)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), model(x), atol=1e-5, rtol=0)


def test_soft_moe_exports_where_eager_runs_the_loop(monkeypatch):
    """From CPU_EQUAL_LOOP_FROM[0] slot rows per expert eager Soft MoE runs the loop in forward (a host sync);
    traced it runs the bmm, so the layer still exports, and the export computes what eager computes."""
    from moespec.layers import Experts, SoftMoE
    from moespec.layers.steps import STEPS
    from moespec.layers.steps.rule import CPU_EQUAL_LOOP_FROM

    torch.manual_seed(0)
    layer = SoftMoE(Experts(2, 8, 16, 8, act=torch.nn.GELU()), slots_per_expert=CPU_EQUAL_LOOP_FROM[0] // 2).eval()
    x = torch.randn(2, 5, 8)  # 2 images x 64 slots: 128 rows per expert
    exported = torch.export.export(layer, (x,))
    loops = []
    loop = STEPS["loop"]
    monkeypatch.setattr(loop, "run", lambda *a: loops.append(1) or type(loop).run(loop, *a))
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(x), layer(x), atol=1e-5, rtol=0)
    assert loops == [1]


DYNAMIC = ["topk", "topk-capacity", "topk-bpr", "topk-drop", "expert_choice", "image", "soft"]


@pytest.mark.parametrize("router", quick_first(DYNAMIC, {"topk"}))
def test_export_with_a_dynamic_batch_runs_at_other_batches_and_onnx_logs_nothing(router, tmp_path, caplog):
    """The README's export: `Dim("batch")` makes the batch dynamic (an export traced at batch 1 refused batch 4),
    and torch.onnx converts the MoE layers without logging "Attribute type is ambiguous" (once per layer, from
    the index_put that built the export path's combine weights). Routers with per-image routing groups
    (capacity, BPR, importance drops, expert choice) used to fix the batch at the traced size: the routing
    groups' sizes were a Python list as long as the batch; now they are two numbers (a full group's, the
    last's)."""
    onnxruntime = pytest.importorskip("onnxruntime")
    model = _model(TINY_VIT, ROUTERS[router])
    batch = {0: torch.export.Dim("batch")}
    program = torch.export.export(model, (torch.randn(2, *TINY_INPUT),), dynamic_shapes=(batch,))
    path = tmp_path / "model.onnx"
    with caplog.at_level("DEBUG"):
        torch.onnx.export(model, (torch.randn(2, *TINY_INPUT),), str(path), dynamo=True, dynamic_shapes=(batch,))
    assert not [r.getMessage() for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for size in 1, 3, 4:
        x = torch.randn(size, *TINY_INPUT)
        with torch.no_grad():
            expected = model(x)
        torch.testing.assert_close(program.module()(x), expected, atol=1e-5, rtol=0)
        (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        torch.testing.assert_close(torch.from_numpy(got), expected, atol=1e-5, rtol=0)

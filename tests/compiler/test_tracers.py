"""Every tracer, or a clear refusal (issue 63): a compiled model runs on the meta device; torch.fx traces it with
each MoE layer as one node (torch.fx.symbolic_trace, torchvision's and timm's feature extraction), which computes
what the eager model computes; torch.jit.script refuses with one moespec error that names torch.export; and
torch.jit.trace runs, warning once in moespec's words that the trace replays the example input's routing."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import timm.models
import torch
from torch import fx
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

import moespec
from moespec.errors import MoespecError, NotScriptableError
from moespec.layers import MoELayer
from moespec.layers.ops import mode as layer_mode

VIT = {"model": "vit_small_patch16_224",
       "kwargs": {"depth": 2, "img_size": 32, "embed_dim": 32, "num_heads": 2, "num_classes": 10}}
PVT = {"model": "pvt_v2_b1", "kwargs": {"depths": [1, 1, 1, 1], "embed_dims": [16, 32, 48, 64],
                                         "num_heads": [1] * 4, "num_classes": 10}}
KINDS = {
    "topk": (VIT, [3, 32, 32], {"where": {"every": 1}, "experts": 4, "top_k": 2}),
    "expert_choice": (VIT, [3, 32, 32], {"where": {"every": 1}, "experts": 4, "router": {"kind": "expert_choice"}}),
    "image": (VIT, [3, 32, 32], {"where": {"every": 1}, "experts": 4, "top_k": 2, "router": {"kind": "image"}}),
    "soft": (VIT, [3, 32, 32], {"where": {"every": 1}, "experts": 4, "router": {"kind": "soft"}}),
    # PVT-v2's FFN mixes positions: whole copies of it, routed per image (`ImageFFNMoE`)
    "whole_ffn": (PVT, [3, 64, 64], {"where": {"last": 1}, "experts": 4,
                                     "router": {"kind": "image", "top_k": 1, "normalize": True}}),
}
"""One model per MoE layer class and router family: MoE with top-k, expert choice and image-level routing,
SoftMoE, ImageFFNMoE."""
MOESPEC = Path(moespec.__file__).parent


def _model(kind: str) -> tuple[torch.nn.Module, torch.Tensor]:
    backbone, size, group = KINDS[kind]
    spec = moespec.load_spec({"name": kind, "backbone": backbone, "input_size": size, "moe": [group]})
    return moespec.create_model(spec, seed=0).eval(), torch.randn(2, *size, generator=torch.Generator().manual_seed(0))


def _moe_paths(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, MoELayer)]


@pytest.fixture
def trace_warning(monkeypatch):
    """The TorchScript trace warns once a process: not yet, for this test."""
    monkeypatch.setattr(layer_mode, "_warned_trace", False)


@pytest.mark.parametrize("kind", KINDS)
def test_the_model_runs_on_the_meta_device(kind):
    model, x = _model(kind)
    with torch.no_grad():
        expected = model(x).shape
        out = model.to("meta")(torch.empty(x.shape, device="meta"))
    assert out.device.type == "meta" and out.shape == expected


@pytest.mark.parametrize("kind", KINDS)
def test_fx_symbolic_trace_calls_each_moe_layer_as_one_node(kind):
    model, x = _model(kind)
    graph = fx.symbolic_trace(model)
    called = [node.target for node in graph.graph.nodes if node.op == "call_module"]
    assert set(_moe_paths(model)) <= set(called)
    assert not any(target.startswith(tuple(f"{path}." for path in _moe_paths(model))) for target in called)
    with torch.no_grad():
        torch.testing.assert_close(graph(x), model(x), atol=0, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_feature_extraction_gives_the_eager_features(kind):
    """torchvision's `create_feature_extractor` (a tracer of its own, no leaf modules named) and timm's (timm's
    notrace modules, which the MoE layers are) return the MoE layers' outputs and the logits of eager forward."""
    model, x = _model(kind)
    paths = _moe_paths(model)
    assert set(paths) <= set(get_graph_node_names(model)[1])
    eager: dict[str, torch.Tensor] = {}
    hooks = [model.get_submodule(path).register_forward_hook(
        lambda module, args, out, path=path: eager.__setitem__(path, out)) for path in paths]
    with torch.no_grad():
        logits = model(x)
        for hook in hooks:
            hook.remove()
        for extract in (create_feature_extractor, timm.models.create_feature_extractor):
            features = extract(model, return_nodes=[*paths, "head"])(x)
            assert list(features) == [*paths, "head"]
            for path in paths:
                torch.testing.assert_close(features[path], eager[path], atol=0, rtol=0)
            torch.testing.assert_close(features["head"], logits, atol=0, rtol=0)


def test_fx_refuses_to_trace_an_moe_layer_on_its_own():
    model, _ = _model("topk")
    layer = model.get_submodule(_moe_paths(model)[0])
    with pytest.raises(MoespecError, match=r"cannot trace a MoE layer on its own.*torch\.export\.export\(layer"):
        fx.symbolic_trace(layer)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_jit_script_is_refused_with_one_moespec_error(kind):
    model, _ = _model(kind)
    layer = type(model.get_submodule(_moe_paths(model)[0])).__name__
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch: TorchScript is deprecated
        with pytest.raises(NotScriptableError, match=rf"torch\.jit\.script cannot compile the {layer} layer.*"
                                                     rf"torch\.export\.export\(model, \(x,\)\)"):
            torch.jit.script(model)


def _trace(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.jit.ScriptModule, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(model, x)  # with torch's check: a second trace, under no_grad, finds the same graph
    return traced, caught


@pytest.mark.parametrize("kind", ["topk", "expert_choice", "whole_ffn"])
def test_torch_jit_trace_warns_once_that_it_fixes_the_routing(kind, trace_warning):
    model, x = _model(kind)
    traced, caught = _trace(model, x)
    ours = [w for w in caught if str(w.message).startswith("moespec:")]
    assert [w.category for w in ours] == [UserWarning]
    assert re.search(r"fixes the routing of its example input.*torch\.export\.export", str(ours[0].message))
    assert [w for w in caught if Path(w.filename).is_relative_to(MOESPEC)] == ours  # no TracerWarning of ours
    with torch.no_grad():
        torch.testing.assert_close(traced(x), model(x), atol=1e-5, rtol=0)
    grads = []
    for run in (model, traced):  # the graph's ops are those autograd differentiates: the eager gradients
        model.zero_grad(set_to_none=True)
        run(x).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for eager, replayed in zip(*grads, strict=True):
        assert (eager is None) == (replayed is None)
        if eager is not None:
            torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-4)
    assert not [w for w in _trace(model, x)[1] if str(w.message).startswith("moespec:")]  # once


def test_torch_jit_trace_of_soft_moe_routes_each_input(trace_warning):
    """Soft MoE's dispatch and combine weights are tensors of every input: its trace computes the layer on any
    input, with no warning."""
    model, x = _model("soft")
    traced, caught = _trace(model, x)
    assert [w for w in caught if Path(w.filename).is_relative_to(MOESPEC)] == []
    other = torch.randn(x.shape)
    with torch.no_grad():
        torch.testing.assert_close(traced(other), model(other), atol=1e-5, rtol=0)


def test_whole_ffn_copies_export_and_match_eager():
    """ImageFFNMoE under torch.export runs every copy on every image, weighted by the routing (no host sync)."""
    model, x = _model("whole_ffn")
    exported = torch.export.export(model, (x,))
    other = torch.randn(x.shape)
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(other), model(other), atol=1e-5, rtol=0)

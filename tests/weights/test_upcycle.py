"""Upcycling: weight copying, splits, router init, checkpoint formats, and function preservation."""

from __future__ import annotations

import pytest
import torch

import moespec
from moespec.errors import CheckpointError, SpecError
from moespec.weights import upcycle_with_report

from ..conftest import TINY_CONVNEXT, TINY_INPUT, TINY_VIT, family_net, line_of, make_spec, write

VIT_EVERY2 = [{"where": {"every": 2}, "experts": 8, "top_k": 2, "router": {"normalize": True}}]


@pytest.mark.parametrize("experts,top_k", [(8, 2), (4, 1), (3, 3)])
@pytest.mark.parametrize("backbone,where", [(TINY_VIT, {"every": 1}), (TINY_CONVNEXT, {"stage_last": 2})],
                         ids=["vit_small", "convnext_tiny"])
def test_normalized_upcycle_reproduces_dense_logits(backbone, where, experts, top_k, dense_checkpoint):
    path, dense = dense_checkpoint(backbone)
    spec = make_spec(backbone, [{"where": where, "experts": experts, "top_k": top_k, "router": {"normalize": True}}])
    model, report = upcycle_with_report(spec, path)
    x = torch.randn(3, *TINY_INPUT)
    with torch.no_grad():
        diff = (model(x) - dense(x)).abs().max().item()
    assert diff <= 1e-5
    assert report.function_preserving and report.max_abs_logit_diff <= 1e-5
    assert str(report).startswith("function-preserving: yes (max |dlogit| = ")


@pytest.mark.parametrize("family", ["NormMlp", "GeGluMlp", "RepVitMlp", "LevitMlp", "FastVitConvMlp", "SequentialMlp",
                                    "Gemma4GatedMlpClipped"])
def test_composed_families_upcycle_to_the_dense_logits(family, dense_checkpoint):
    """A shared `pre` module copied, BatchNorms folded into the experts, clamp bounds copied: the eval-mode
    function is the dense one."""
    path, dense = dense_checkpoint(family_net(family))
    spec = make_spec(family_net(family), [{"where": {"every": 1}, "experts": 4, "top_k": 1,
                                           "router": {"normalize": True}}])
    model, report = upcycle_with_report(spec, path)
    x = torch.randn(3, *TINY_INPUT)
    with torch.no_grad():
        diff = (model.eval()(x) - dense(x)).abs().max().item()
    assert diff <= 1e-5 and report.function_preserving
    layer = model.blocks[0].mlp
    assert (layer.pre is None) == (family in ("RepVitMlp", "LevitMlp", "SequentialMlp", "Gemma4GatedMlpClipped"))
    if family == "Gemma4GatedMlpClipped":
        assert layer.experts.clamp[2].tolist() == pytest.approx([-0.7, 0.8, -0.07, 0.06])  # down_proj's bounds


def test_unnormalized_top_k_is_reported_not_preserving(dense_checkpoint):
    path, _ = dense_checkpoint(TINY_VIT)
    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 8, "top_k": 2, "router": {"normalize": False}}])
    _, report = upcycle_with_report(spec, path)
    # top-2 of 8 softmax gates sum to < 1, so the FFN branch is scaled down: a real gap, reported
    assert not report.function_preserving and report.max_abs_logit_diff > 1e-3
    assert str(report).startswith("function-preserving: no (max |dlogit| = ")


def test_non_ffn_weights_are_copied_and_experts_are_dense_copies(dense_checkpoint):
    path, dense = dense_checkpoint(TINY_VIT)
    model = moespec.upcycle(make_spec(TINY_VIT, VIT_EVERY2), path)
    dense_state, state = dense.state_dict(), model.state_dict()
    for key, value in state.items():
        if ".mlp." not in key or key.startswith("blocks.0."):
            assert torch.equal(value, dense_state[key]), key
    for e in range(8):
        assert torch.equal(state["blocks.1.mlp.experts.fc1.weight"][e], dense_state["blocks.1.mlp.fc1.weight"])
        assert torch.equal(state["blocks.1.mlp.experts.fc2.bias"][e], dense_state["blocks.1.mlp.fc2.bias"])


@pytest.mark.parametrize("split", ["slice", "partition"])
def test_narrow_experts_take_hidden_units_by_split(split, dense_checkpoint):
    path, dense = dense_checkpoint(TINY_VIT)
    spec = make_spec(TINY_VIT, [{"where": {"last": 1}, "experts": 4, "expert_hidden": 384, "shared_experts": 1}],
                     upcycle={"split": split})
    state, dense_state = moespec.upcycle(spec, path).state_dict(), dense.state_dict()
    fc1, fc1_bias, fc2 = (dense_state[f"blocks.1.mlp.{n}"] for n in ("fc1.weight", "fc1.bias", "fc2.weight"))
    for e in range(4):
        start = 384 * e if split == "partition" else 0
        units = slice(start, start + 384)
        assert torch.equal(state["blocks.1.mlp.experts.fc1.weight"][e], fc1[units])
        assert torch.equal(state["blocks.1.mlp.experts.fc1.bias"][e], fc1_bias[units])
        assert torch.equal(state["blocks.1.mlp.experts.fc2.weight"][e], fc2[:, units])
    assert torch.equal(state["blocks.1.mlp.shared.fc1.weight"][0], fc1[:384])  # shared expert: leading units


def test_router_init_and_noise(dense_checkpoint):
    path, dense = dense_checkpoint(TINY_VIT)
    zeros = moespec.upcycle(make_spec(TINY_VIT, VIT_EVERY2, upcycle={"router_init": "zeros"}), path).state_dict()
    assert torch.count_nonzero(zeros["blocks.1.mlp.router.gate.weight"]) == 0
    normal = moespec.upcycle(make_spec(TINY_VIT, VIT_EVERY2, upcycle={"noise": 0.01}), path).state_dict()
    gate = normal["blocks.1.mlp.router.gate.weight"]
    assert gate.std().item() == pytest.approx(0.02, rel=0.15)
    delta = normal["blocks.1.mlp.experts.fc1.weight"] - dense.state_dict()["blocks.1.mlp.fc1.weight"]
    assert delta.std().item() == pytest.approx(0.01, rel=0.05)
    assert not torch.equal(delta[0], delta[1])  # each expert gets its own noise


@pytest.mark.parametrize("layout", ["safetensors", "pth", "pth-state_dict", "bin-model", "pth-module-prefix"])
def test_dense_checkpoint_formats(layout, dense_checkpoint, tmp_path):
    source, dense = dense_checkpoint(TINY_VIT)
    state = dense.state_dict()
    path = {
        "safetensors": source,
        "pth": tmp_path / "d.pth",
        "pth-state_dict": tmp_path / "d2.pth",
        "bin-model": tmp_path / "d.bin",
        "pth-module-prefix": tmp_path / "d3.pth",
    }[layout]
    payload = {"pth": state, "pth-state_dict": {"state_dict": state, "epoch": 3}, "bin-model": {"model": state},
               "pth-module-prefix": {f"module.{k}": v for k, v in state.items()}}.get(layout)
    if payload is not None:
        torch.save(payload, path)
    model = moespec.upcycle(make_spec(TINY_VIT, VIT_EVERY2), path)
    assert torch.equal(model.state_dict()["blocks.1.norm1.weight"], state["blocks.1.norm1.weight"])


def test_checkpoint_from_the_spec_is_relative_to_the_spec_file(dense_checkpoint, tmp_path):
    path, dense = dense_checkpoint(TINY_VIT, name="weights.safetensors")
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(
        "backbone:\n  model: vit_small_patch16_224\n  kwargs: {depth: 2, img_size: 64, num_classes: 10}\n"
        "  checkpoint: weights.safetensors\ninput_size: [3, 64, 64]\nmoe:\n  - {where: {last: 1}, experts: 2}\n")
    model = moespec.upcycle(moespec.load_spec(spec_file))
    assert torch.equal(model.state_dict()["pos_embed"], dense.state_dict()["pos_embed"])


def test_wrong_checkpoint_lists_missing_unexpected_and_mismatched(dense_checkpoint):
    path, _ = dense_checkpoint({"model": "vit_small_patch16_224",
                                "kwargs": {"depth": 1, "img_size": 64, "num_classes": 7, "mlp_ratio": 2.0}})
    with pytest.raises(CheckpointError) as err:
        moespec.upcycle(make_spec(TINY_VIT, VIT_EVERY2), path)
    message = str(err.value)
    assert "missing keys: blocks.1.norm1.weight" in message
    # (a head for another num_classes is not a mismatch: it is dropped, as timm does; see test_fit.py)
    assert "shape mismatches: blocks.0.mlp.fc1.weight: checkpoint (768, 384) vs model (1536, 384)" in message


def test_unreadable_and_absent_checkpoints(tmp_path):
    spec = make_spec(TINY_VIT, VIT_EVERY2)
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        moespec.upcycle(spec, tmp_path / "absent.safetensors")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="broken.safetensors: not a readable safetensors file .*is it truncated"):
        moespec.upcycle(spec, broken)


def test_an_absent_checkpoint_of_the_spec_is_located_in_the_spec(tmp_path):
    text = ("backbone:\n  model: vit_small_patch16_224\n  kwargs: {depth: 2, img_size: 64, num_classes: 10}\n"
            "  checkpoint: absent.safetensors\n")
    spec = moespec.load_spec(write(tmp_path, text))
    with pytest.raises(SpecError) as err:
        moespec.upcycle(spec)
    problem, = err.value.problems
    assert (problem.path, problem.line) == ("backbone.checkpoint", line_of(text, "checkpoint:"))
    assert problem.message.startswith(f"no such checkpoint file {str(tmp_path / 'absent.safetensors')!r}")


def test_experts_wider_than_the_dense_ffn_cannot_be_upcycled(dense_checkpoint):
    path, _ = dense_checkpoint(TINY_VIT)
    spec = make_spec(TINY_VIT, [{"where": {"last": 1}, "experts": 2, "expert_hidden": 2048}])
    with pytest.raises(SpecError, match="cannot be upcycled from a dense FFN of 1536") as err:
        moespec.upcycle(spec, path)
    assert err.value.problems[0].path == "moe.0.expert_hidden"


@pytest.mark.parametrize("experts,top_k", [(4, 1), (4, 2)])
def test_image_routing_upcycle_reproduces_dense_logits(experts, top_k, dense_checkpoint):
    path, dense = dense_checkpoint(TINY_VIT)
    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": experts, "top_k": top_k,
                                 "router": {"kind": "image", "normalize": True}}])
    model, report = upcycle_with_report(spec, path)
    assert moespec.plan(spec).layers[0].router.pool == "cls"  # ViT has a [CLS] token
    x = torch.randn(3, *TINY_INPUT)
    with torch.no_grad():
        assert (model(x) - dense(x)).abs().max().item() <= 1e-5
    assert report.function_preserving


@pytest.mark.parametrize("router,shared,reason", [
    ({"kind": "topk", "normalize": True}, 1, "1 shared expert(s) add another copy of the dense FFN's output"),
    ({"kind": "soft"}, 0, "Soft MoE feeds experts convex mixtures of all tokens, not each token itself"),
])
def test_shared_experts_and_soft_moe_say_plainly_that_they_change_the_function(router, shared, reason,
                                                                               dense_checkpoint):
    path, _ = dense_checkpoint(TINY_VIT)
    spec = make_spec(TINY_VIT, [{"where": {"last": 1}, "experts": 4, "shared_experts": shared, "router": router}])
    model, report = upcycle_with_report(spec, path)
    assert not report.function_preserving and report.max_abs_logit_diff > 1e-3
    lines = str(report).splitlines()
    assert lines[0] == f"function-preserving: no (max |dlogit| = {report.max_abs_logit_diff:.3g})"
    assert lines[1:] == [f"  because moe.0: {reason}"]
    state = model.state_dict()
    if shared:  # the shared expert is the dense FFN too
        assert torch.equal(state["blocks.1.mlp.shared.fc1.weight"][0], state["blocks.1.mlp.experts.fc1.weight"][0])


def test_buffers_may_be_unbounded_but_nothing_may_be_nan():
    """A fresh Gemma 4 clippable linear's bounds are +-Inf buffers: upcycling takes them. A NaN anywhere, or an
    Inf in a weight, is refused."""
    from moespec.weights import refuse_non_finite

    inf = torch.tensor([-float("inf"), float("inf")])
    refuse_non_finite({"clip.bounds": inf, "fc.weight": torch.ones(2)}, "src", buffers={"clip.bounds"})
    for state in ({"clip.bounds": torch.tensor([float("nan")]), "fc.weight": torch.ones(2)},
                  {"clip.bounds": inf, "fc.weight": inf}):
        with pytest.raises(CheckpointError, match="hold NaN or Inf values"):
            refuse_non_finite(state, "src", buffers={"clip.bounds"})

"""The spec options V-MoE needs: a top-k router's `capacity_multiple` (vmoe rounds capacities up to a multiple of
4) and `backbone.pre_logits` (ViT's representation layer)."""

from __future__ import annotations

import pytest
import torch

import moespec
from moespec.errors import SpecError
from moespec.layers import LinearGate, TopKRouter

TINY_VIT = {"model": "vit_tiny_patch16_224", "kwargs": {"img_size": 32, "depth": 2, "num_classes": 10}}


def _spec(router: dict, backbone: dict = TINY_VIT) -> moespec.Spec:
    return moespec.load_spec({"backbone": backbone, "moe": [{"where": {"blocks": [1]}, "experts": 4,
                                                             "router": router}]})


def test_capacity_multiple_rounds_the_capacity_up():
    """ceil(0.5 * 2 * 10 / 4) = 3 slots; vmoe's rounding makes it 4; 6 stays 8 at 1.05, 12 stays 12 at 2.0."""
    for factor, plain, rounded in ((0.5, 3, 4), (1.05, 6, 8), (2.0, 10, 12)):
        routers = [TopKRouter(LinearGate(8, 4), 4, 2, capacity_factor=factor, capacity_multiple=m) for m in (1, 4)]
        assert [router.capacity(10) for router in routers] == [plain, rounded]
    router = TopKRouter(LinearGate(8, 4), 4, 2, capacity_factor=0.5, capacity_multiple=4, eval_capacity_factor=None)
    assert router.eval().capacity(10) is None  # dropless in eval: nothing to round


def test_capacity_multiple_needs_a_capacity():
    with pytest.raises(SpecError, match="moe.0.router.capacity_multiple: capacity_multiple rounds a capacity, and "
                                        "this router is dropless"):
        _spec({"top_k": 2, "capacity_multiple": 4})
    assert _spec({"top_k": 2, "capacity_multiple": 4, "eval_capacity_factor": 2.0}).moe[0].router.capacity_multiple == 4
    with pytest.raises(SpecError, match="capacity_multiple"):
        _spec({"top_k": 2, "capacity_factor": 1.0, "capacity_multiple": 0})


def test_the_plan_shows_the_rounding():
    spec = _spec({"top_k": 2, "capacity_factor": 1.05, "capacity_multiple": 4, "group": 2})
    assert "capacity-multiple=4" in moespec.plan(spec).layers[0].router.describe(moespec.plan(spec).layers[0])
    assert moespec.create_model(spec).blocks[1].mlp.router.capacity_multiple == 4


def test_pre_logits_is_a_tanh_layer_in_fc_norms_place():
    spec = moespec.load_spec({"backbone": {**TINY_VIT, "pre_logits": True}})
    model = moespec.create_model(spec, seed=0).eval()
    width = model.embed_dim
    assert model.fc_norm.fc.weight.shape == (width, width)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        features = model.forward_features(x)
        representation = model.forward_head(features, pre_logits=True)
        assert torch.allclose(representation, torch.tanh(model.fc_norm.fc(features[:, 0])))
        assert torch.allclose(model(x), model.head(representation))
    model.reset_classifier(3)  # timm's head swap keeps the representation layer
    assert model.fc_norm.fc.weight.shape == (width, width) and model(x).shape == (2, 3)
    plain = moespec.stats(moespec.load_spec({"backbone": TINY_VIT}))
    assert moespec.stats(spec).total_params - plain.total_params == width * width + width


def test_pre_logits_on_a_model_that_is_not_a_vit():
    spec = moespec.load_spec({"backbone": {"model": "convnext_atto", "kwargs": {"num_classes": 10},
                                           "pre_logits": True}})
    with pytest.raises(SpecError, match=r"backbone.pre_logits: pre_logits is ViT's representation layer, .* "
                                        r"convnext_atto is a ConvNeXt, which has none"):
        moespec.plan(spec)

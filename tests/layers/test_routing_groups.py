"""Routing groups: in eval mode an image's MoE output does not depend on the other images of its batch (the
default, `group: image`), or only on its group of N (`group: N`); capacity, expert choice's C, BPR order and
importance drops are decided per group, in one batched pass."""

from __future__ import annotations

import functools

import pytest
import torch

import moespec
from moespec.backbones import create_backbone
from moespec.compiler import build_moe
from moespec.planning import plan_for

from ..conftest import TINY_CONVNEXT, TINY_VIT, make_spec, quick_first

# every router kind, and every topk option that couples the items of a group
ROUTERS = {
    "topk-capacity": {"top_k": 2, "capacity_factor": 1.0},
    "topk-capacity-k1-tight": {"top_k": 1, "capacity_factor": 0.5},
    "topk-bpr": {"top_k": 1, "capacity_factor": 0.75, "router": {"kind": "topk", "bpr": True}},
    "topk-drop": {"top_k": 2, "router": {"kind": "topk", "drop_fraction": 0.25}},
    "topk-drop-capacity-bpr": {"top_k": 2, "capacity_factor": 1.0,
                               "router": {"kind": "topk", "drop_fraction": 0.2, "bpr": True}},
    "expert_choice": {"router": {"kind": "expert_choice"}},
    "expert_choice-c2": {"router": {"kind": "expert_choice", "capacity": 2.0}},
    "topk-dropless": {"top_k": 2},
    "image": {"top_k": 2, "router": {"kind": "image"}},
    "soft": {"router": {"kind": "soft"}},
}
COUPLED = [name for name in ROUTERS if name not in ("topk-dropless", "image", "soft")]
CONVNEXT_CONV_MLP = {**TINY_CONVNEXT, "kwargs": {**TINY_CONVNEXT["kwargs"], "conv_mlp": True}}
MIXER = {"model": "mixer_s32_224", "kwargs": {"img_size": 64, "num_blocks": 2, "embed_dim": 64}}


# (backbone, sublayer, shape of one image's input to the FFN)
INPUTS = {
    "vit-tokens": (TINY_VIT, "mlp", (17, 384)),
    "convnext-channels-last": (TINY_CONVNEXT, "mlp", (2, 2, 768)),
    "convnext-channels-first": (CONVNEXT_CONV_MLP, "mlp", (768, 2, 2)),
    "mixer-token-mixing": (MIXER, "mlp_tokens", (64, 4)),  # the items are channel rows of length S = 4
}


@functools.cache
def _dense(inputs: str) -> torch.nn.Module:
    return create_backbone(make_spec(INPUTS[inputs][0], []))


def _layer(inputs: str, router: str, group=None) -> torch.nn.Module:
    """The MoE layer of the last block's FFN, built from the plan as `create_model` builds it (the dense
    backbone is built once per test module)."""
    backbone, sublayer, _ = INPUTS[inputs]
    entry = {"where": {"last": 1}, "experts": 4, "sublayer": sublayer, **ROUTERS[router]}
    if group is not None:
        entry["router"] = {**entry.get("router", {"kind": "topk"}), "group": group}
    dense = _dense(inputs)
    (plan,) = plan_for(make_spec(backbone, [entry]), dense).layers
    torch.manual_seed(0)
    return build_moe(plan, dense.get_submodule(plan.path)).eval()


def _check(layer, x: torch.Tensor, group: int) -> float:
    """Max |layer(batch) - layer(each group of `group` images alone)|, in float64, so that what differs is
    the routing, not the rounding of batched matmuls of other sizes."""
    layer, x = layer.double(), x.double()
    with torch.no_grad():
        together = layer(x)
        alone = torch.cat([layer(x[i:i + group]) for i in range(0, x.shape[0], group)])
    return (together - alone).abs().max().item()


def _matrix(routers) -> list:
    """(inputs, router) cases: every router on every input in CI; in the quick run, on ConvNeXt's feature maps
    (ten times the time of the others) only the routers that couple the most (capacity, BPR with drops,
    expert choice with C = 2)."""
    cases = [(inputs, router) for inputs in INPUTS for router in routers]
    ids = [f"{inputs}-{router}" for inputs, router in cases]
    quick = {name for name, (inputs, router) in zip(ids, cases, strict=True)
             if not inputs.startswith("convnext") or router in CONVNEXT_QUICK}
    return quick_first(cases, quick, ids)


CONVNEXT_QUICK = ("topk-capacity", "topk-drop-capacity-bpr", "expert_choice-c2")


@pytest.mark.parametrize("inputs,router", _matrix(ROUTERS))
def test_by_default_an_image_is_routed_alone(router, inputs):
    if router in ("image", "soft") and inputs != "vit-tokens":
        pytest.skip("image routing and Soft MoE are defined on token sequences")
    shape = INPUTS[inputs][2]
    layer = _layer(inputs, router)
    x = torch.randn(8, *shape, generator=torch.Generator().manual_seed(0))
    assert _check(layer, x, 1) <= 1e-6


@pytest.mark.parametrize("inputs,router", _matrix(COUPLED))
def test_group_two_routes_each_pair_alone(router, inputs):
    shape = INPUTS[inputs][2]
    layer = _layer(inputs, router, group=2)
    x = torch.randn(8, *shape, generator=torch.Generator().manual_seed(1))
    assert _check(layer, x, 2) <= 1e-6
    assert _check(layer, x, 1) > 1e-4  # and it is a real group: a pair is not two images alone


@pytest.mark.parametrize("router", COUPLED)
def test_group_batch_is_the_old_batch_wide_routing(router):
    layer = _layer("vit-tokens", router, group="batch")
    x = torch.randn(8, 17, 384, generator=torch.Generator().manual_seed(2))
    assert _check(layer, x, 8) == 0.0
    assert _check(layer, x, 1) > 1e-4  # images couple: the reason the default is `image`


def test_in_eval_the_last_group_is_shorter():
    layer = _layer("vit-tokens", "expert_choice", group=4)
    x = torch.randn(6, 17, 384, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        together = layer(x)
        torch.testing.assert_close(together[4:], layer(x[4:]), atol=1e-6, rtol=0)  # a group of 2 images
        torch.testing.assert_close(together[:4], layer(x[:4]), atol=1e-6, rtol=0)


def test_in_training_a_batch_must_be_a_multiple_of_the_group():
    layer = _layer("vit-tokens", "topk-capacity", group=4).train()
    with pytest.raises(ValueError, match="a training batch of 6 images is not a multiple of the routing group of 4"):
        layer(torch.randn(6, 17, 384))
    layer(torch.randn(8, 17, 384))


def test_capacity_is_per_group_by_hand():
    """Tiny ViT, 17 tokens per image, E = 4, k = 1, c = 1: group image, ceil(17 / 4) = 5 per expert and image;
    group 2, ceil(34 / 4) = 9 per expert and pair. With 8 images every token of a skewed batch competes."""
    x = torch.randn(8, 17, 384, generator=torch.Generator().manual_seed(4))
    for group, per_group_capacity, images in ((None, 5, 1), (2, 9, 2), ("batch", 34, 8)):
        layer = _layer("vit-tokens", "topk-capacity", group=group)
        layer.router.top_k = 1
        with torch.no_grad():
            layer(x)
        counts = layer.last_routing.counts
        assert counts.max().item() <= per_group_capacity * 8 // images
        assert counts.sum().item() <= 4 * per_group_capacity * 8 // images


@pytest.mark.parametrize("group,capacity,images", [(None, 5, 1), (1, 5, 1), (2, 9, 2), ("batch", 5, 1)])
def test_executed_macs_count_capacity_per_group(group, capacity, images):
    """executed_gmacs per image, every group full: E * ceil(c * k * T_group / E) rows per group of `images`
    images (17 tokens each; `batch` is costed at the stats' batch of 1). Expert + combine per row, gate per
    token; the activated figure does not change."""
    router = {"kind": "topk"} if group is None else {"kind": "topk", "group": group}
    spec = make_spec(TINY_VIT, [{"where": {"last": 1}, "experts": 4, "top_k": 1, "capacity_factor": 1.0,
                                 "router": router}])
    layer = moespec.stats(spec).layers[0]
    tokens, expert = 17, 2 * 384 * 1536
    assert layer.executed_gmacs * 1e9 == pytest.approx(tokens * 384 * 4 + 4 * capacity * (expert + 384) / images)
    assert round(layer.gmacs * 1e9) == tokens * (384 * 4 + expert + 384)


def test_plan_shows_the_group():
    spec = make_spec(TINY_VIT, [{"where": {"last": 1}, "experts": 4, "capacity_factor": 1.0,
                                 "router": {"kind": "topk", "group": 8}},
                                {"where": {"first": 1}, "experts": 4, "router": {"kind": "expert_choice"}}])
    text = str(moespec.plan(spec))
    assert "topk/linear cf=1.0 group=8" in text and "expert_choice/linear c=1 group=image" in text

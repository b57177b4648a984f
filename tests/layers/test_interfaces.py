"""The declared interfaces (moespec/layers/interfaces.py): every router kind builds an `MoELayer`, every
sparse layer's router is a `Router`, and one rule, `experts_per_item`, gives both the activated parameters
and the activated MACs."""

from __future__ import annotations

import pytest

import moespec
from moespec.compiler import moe_layers
from moespec.layers import MoE, MoELayer, Router
from moespec.spec import ROUTER_KINDS

from ..conftest import TINY_VIT, make_spec

ROUTERS = {"topk": {"kind": "topk", "top_k": 2}, "expert_choice": {"kind": "expert_choice", "capacity": 2.0},
           "soft": {"kind": "soft"}, "image": {"kind": "image", "top_k": 2}}


def test_every_built_in_kind_is_covered():
    assert set(ROUTERS) == set(ROUTER_KINDS)


@pytest.mark.parametrize("kind", ROUTERS)
def test_each_kind_builds_a_declared_layer_with_no_reporting_placeholders(kind):
    model = moespec.create_model(make_spec(TINY_VIT, [{"where": {"last": 1}, "experts": 4,
                                                      "router": ROUTERS[kind]}]), device="meta")
    (layer,) = moe_layers(model).values()
    assert isinstance(layer, MoELayer)
    if isinstance(layer, MoE):
        assert isinstance(layer.router, Router)
    # k is the router spec's (the plan's k column, the stats' top_k): no module carries a `top_k = 1` for it
    assert not hasattr(layer, "top_k")
    if kind in ("expert_choice", "soft"):
        assert not hasattr(getattr(layer, "router", layer), "top_k")


def test_experts_per_item_gives_both_the_activated_params_and_the_macs():
    """Tiny ViT-S (17 tokens, C = 384, FFN 384 -> 1536 -> 384), expert choice, 4 experts, c = 2: each expert
    takes C = round(2 * 17 / 4) = 8 tokens, 32 expert rows for 17 tokens, so a token uses 32/17 experts."""
    tokens, dim, hidden, experts = 17, 384, 1536, 4
    per_expert = dim * hidden + hidden + hidden * dim + dim  # fc1 and fc2 with biases: 1,181,568
    gate = experts * dim  # the linear gate: 1,536 parameters, 1,536 MACs per token
    spec = make_spec(TINY_VIT, [{"where": {"last": 1}, "experts": experts, "router": ROUTERS["expert_choice"]}])
    (layer,) = moespec.stats(spec).layers
    assert layer.activated_params == gate + 32 * per_expert // 17  # 2,224,128: 32 x 1,181,568 is 17 x 2,224,128
    assert round(layer.gmacs * 1e9) == tokens * gate + 32 * (2 * dim * hidden + dim)
    assert layer.activated == "per token, on average (c = 2 experts)"


@pytest.mark.parametrize("kind", ["topk", "expert_choice", "image"])
def test_a_router_called_on_its_own_decides_its_mode_and_routes_as_in_its_layer(kind):
    """`router.route(items, images)` without a mode (as ../shared/gpu/gpu_check.py calls it for its reference)
    decides one of its own, `Mode.of(items)`, and routes the items as the layer routes them."""
    import torch

    from moespec.layers import Mode

    model = moespec.create_model(make_spec(TINY_VIT, [{"where": {"last": 1}, "experts": 4,
                                                      "router": ROUTERS[kind]}]), seed=0).eval()
    (layer,) = moe_layers(model).values()
    items = torch.randn(2 * 5, layer.experts.in_features)
    with torch.no_grad():
        alone = layer.router.route(items, 2)
        layer(items.view(2, 5, -1))
    assert alone.mode == Mode.of(items)
    assert torch.equal(alone.item, layer.last_routing.item) and torch.equal(alone.weights, layer.last_routing.weights)

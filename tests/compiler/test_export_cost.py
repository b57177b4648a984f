"""What an exported graph computes (issue 63, point 6): each layer's `exported_macs` against torch's own
FlopCounterMode on that layer exported with `torch.export`, for every router kind (its matmuls: the gate, every
expert on every item, the combine; Soft MoE's dispatch and combine). tools/export_cost.py sums them into
docs/training.md's table."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import moespec

ROUTERS = {"topk": {"kind": "topk", "top_k": 2}, "expert-choice": {"kind": "expert_choice", "capacity": 1.0},
           "image": {"kind": "image", "top_k": 1}, "soft": {"kind": "soft", "slots_per_expert": 2}}


@pytest.mark.parametrize("router", list(ROUTERS))
def test_exported_macs_are_what_the_exported_layer_multiplies(router):
    spec = moespec.load_spec({"name": router, "input_size": [3, 32, 32], "backbone": {
        "model": "vit_small_patch16_224",
        "kwargs": {"depth": 1, "img_size": 32, "embed_dim": 32, "num_heads": 2, "num_classes": 10}},
        "moe": [{"where": {"every": 1}, "experts": 4, "shared_experts": 1 if router == "topk" else 0,
                 "router": ROUTERS[router]}]})
    layer = next(iter(moespec.moe_layers(moespec.create_model(spec).eval()).values()))
    images, per_image = 2, 5
    x = torch.randn(images, per_image, 32)
    exported = torch.export.export(layer, (x,))
    with FlopCounterMode(display=False) as counter:
        exported.module()(x)
    assert counter.get_total_flops() == 2 * layer.exported_macs(images * per_image, images)
    if router == "soft":  # exported as it runs
        assert layer.exported_macs(10, 2) == layer.activated_macs(10, 2)
    else:  # every expert on every item: more than the routing activates
        assert layer.exported_macs(10, 2) > layer.activated_macs(10, 2)

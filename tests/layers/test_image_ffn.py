"""FFNs that mix positions (PVT-v2's depthwise conv, EfficientFormer-V2's `mid` conv, gMLP's spatial gating
unit) under image-level routing: each expert a whole copy of the FFN (`ImageFFNMoE`). They plan, build, train,
upcycle to the dense function and count by hand; under token routing the refusal names `kind: image` (issue 51)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import moespec
from moespec.backbones import create_backbone
from moespec.compiler import moe_layers
from moespec.layers import ImageFFNMoE

from ..conftest import randomize

C, H = 64, 256  # the last stage's width and FFN hidden width of the tiny PVT-v2 and EfficientFormer-V2
PVT = {"model": "pvt_v2_b1", "kwargs": {"depths": [1, 1, 1, 1], "embed_dims": [16, 32, 48, C], "num_heads": [1] * 4,
                                         "num_classes": 10}}
EFFICIENTFORMER = {"model": "efficientformerv2_s1", "kwargs": {"depths": [1, 1, 2, 2], "embed_dims": [16, 32, 48, C],
                                                                 "num_classes": 10}}
GMLP = {"model": "gmlp_s16_224", "kwargs": {"num_blocks": 2, "embed_dim": 32, "img_size": 64, "num_classes": 10}}
# (backbone, input size, MoE blocks, FFN params by hand, one FFN's MACs on one image by hand, width, positions)
CASES = {
    # fc1 C->H, a 3x3 depthwise conv on H, fc2 H->C, all with biases; at 64 px the last stage is 2 x 2 positions.
    "pvt_v2": (PVT, [3, 64, 64], 1, (C * H + H) + (9 * H + H) + (H * C + C), 4 * (C * H + 9 * H + H * C), C, 4),
    # 1x1 conv C->H + BatchNorm, 3x3 depthwise conv + BatchNorm (`mid`), 1x1 conv H->C + BatchNorm, conv biases;
    # fvcore counts an eval affine BatchNorm as 2 MACs per element. At 224 px the last stage is 7 x 7 positions.
    "efficientformerv2": (EFFICIENTFORMER, [3, 224, 224], 2,
                          (C * H + H + 2 * H) + (9 * H + H + 2 * H) + (H * C + C + 2 * C),
                          49 * (C * H + 2 * H + 9 * H + 2 * H + H * C + 2 * C), C, 49),
    # gMLP, width 32, 16 tokens: fc1 32->192, the gate's LayerNorm on 96 and its token projection 16->16 (with
    # bias), fc2 96->32; fvcore counts 5 MACs per element of an affine LayerNorm.
    "gmlp": (GMLP, [3, 64, 64], 1, (32 * 192 + 192) + 2 * 96 + (16 * 16 + 16) + (96 * 32 + 32),
             16 * 32 * 192 + 5 * 16 * 96 + 96 * 16 * 16 + 16 * 96 * 32, 32, 16),
}
IMAGE = {"kind": "image", "top_k": 1, "normalize": True}


def _spec(case: str, router: dict, **group) -> moespec.Spec:
    backbone, size, blocks, *_ = CASES[case]
    return moespec.load_spec({"name": case, "backbone": backbone, "input_size": size,
                              "moe": [{"where": {"last": blocks}, "experts": 4, "router": router, **group}]})


@pytest.mark.parametrize("case", CASES)
def test_token_routing_is_refused_and_names_image_routing(case):
    with pytest.raises(moespec.SpecError, match=r"moe\.0\.router: .*mixes .*an expert under topk routing sees only "
                                                r"the positions routed to it; route whole images instead, with "
                                                r"router: \{kind: image\}"):
        moespec.plan(_spec(case, {"kind": "topk", "top_k": 1}))


def test_a_narrower_expert_is_refused():
    with pytest.raises(moespec.SpecError, match=r"moe\.0\.expert_hidden: .*a whole copy of it, at its hidden width "
                                                r"256, not 128; leave expert_hidden out"):
        moespec.plan(_spec("pvt_v2", IMAGE, expert_hidden=128))


@pytest.mark.parametrize("case", CASES)
def test_plan_build_and_train(case):
    spec = _spec(case, {**IMAGE, "top_k": 2}, aux_loss=[{"kind": "switch", "weight": 0.01}])
    model = moespec.create_model(spec, seed=0).train()
    layers = moe_layers(model)
    assert layers and all(isinstance(layer, ImageFFNMoE) for layer in layers.values())
    images = torch.randn(3, *spec.input_size)
    # features, not logits: timm zero-initializes some heads (gMLP's), which would stop every gradient
    loss = model.forward_features(images).square().mean() + moespec.aux_loss(model)
    loss.backward()
    for path, layer in layers.items():
        used = layer.last_routing.counts > 0
        grads = [any(p.grad is not None and p.grad.abs().sum() > 0 for p in copy.parameters())
                 for copy in layer.experts.copies]
        assert grads == used.tolist(), path  # every expert that took an image learned, the others did not
        assert layer.router.gate.weight.grad.abs().sum() > 0, path


@pytest.mark.parametrize("case", CASES)
def test_upcycled_with_identical_experts_is_the_dense_model(case, tmp_path):
    spec = _spec(case, IMAGE)
    dense = randomize(create_backbone(spec)).eval()  # timm's gmlp_s16_224(num_blocks=...) clashes: moespec's build
    path = tmp_path / "dense.safetensors"
    save_file({k: v.contiguous() for k, v in dense.state_dict().items()}, str(path))
    model = moespec.upcycle(spec, path).eval()
    x = torch.randn(2, *CASES[case][1])
    with torch.no_grad():
        ours, theirs = model(x), dense(x)
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def test_drop_upcycling_is_refused_for_whole_copies(tmp_path):
    spec = moespec.load_spec({**_spec("pvt_v2", IMAGE).model_dump(exclude_none=True), "upcycle": {"drop": 0.5}})
    dense = create_backbone(spec)
    path = tmp_path / "dense.safetensors"
    save_file({k: v.contiguous() for k, v in dense.state_dict().items()}, str(path))
    with pytest.raises(moespec.SpecError, match=r"upcycle\.drop: .*whole copies of an FFN that mixes positions"):
        moespec.upcycle(spec, path)


@pytest.mark.parametrize("case", CASES)
def test_counts_by_hand(case):
    _, _, blocks, ffn_params, ffn_macs, width, positions = CASES[case]
    s = moespec.stats(_spec(case, IMAGE))
    router = width * 4  # a linear gate over 4 experts, read once per image
    assert s.total_params == s.dense_params + blocks * (3 * ffn_params + router)
    assert s.activated_params == s.dense_params + blocks * router
    for layer in s.layers:
        # one whole FFN per image, the gate once, the weighted combine on every position's channels
        assert round(layer.gmacs * 1e9) == ffn_macs + router + positions * width, layer.path
        assert layer.activated == "per image" and layer.items == positions
    assert round((s.gmacs - s.dense_gmacs) * 1e9) == blocks * (router + positions * width)

"""Detection and segmentation backbones of a registered MoE spec (issue 48, point 5): timm's `features_only`
and `forward_intermediates`, for a ViT and a ConvNeXt, with the MoE layers' aux losses in the gradients."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.models import save_for_hf
from timm.models._features import FeatureGetterNet, FeatureListNet

import moespec

AUX = {"kind": "switch", "weight": 0.5}
VIT = {"name": "features-vit", "input_size": [3, 32, 32],
       "backbone": {"model": "vit_small_patch16_224",
                    "kwargs": {"depth": 3, "embed_dim": 64, "num_heads": 2, "img_size": 32, "patch_size": 8}},
       "moe": [{"where": {"every": 1}, "experts": 4, "router": {"kind": "topk", "top_k": 2}, "aux_loss": AUX}]}
CONVNEXT = {"name": "features-convnext", "input_size": [3, 32, 32],
            "backbone": {"model": "convnext_atto", "kwargs": {"depths": [1, 1, 2, 1]}},
            "moe": [{"where": {"every": 1}, "experts": 2, "router": {"kind": "topk", "top_k": 1}, "aux_loss": AUX}]}
# out_indices (0, 1): the ViT's first two blocks (the third is pruned), the ConvNeXt's first two stages
SHAPES = {"vit": [(2, 64, 4, 4), (2, 64, 4, 4)], "convnext": [(2, 40, 8, 8), (2, 80, 4, 4)]}
LAYERS = {"vit": 2, "convnext": 2}  # MoE layers the features run: ViT blocks 0-1, ConvNeXt stages 0-1 (one block each)
WRAPPERS = {"vit": FeatureGetterNet, "convnext": FeatureListNet}  # what timm wraps the dense model in


def _router_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if ".router." in name and p.grad is not None}


@pytest.mark.parametrize("kind,document", [("vit", VIT), ("convnext", CONVNEXT)])
def test_features_only_is_a_timm_feature_backbone_whose_aux_loss_reaches_the_routers(kind, document):
    name = moespec.register_timm(moespec.load_spec(document), name=f"moespec_test_{kind}_features")
    torch.manual_seed(0)
    features = timm.create_model(name, features_only=True, out_indices=(0, 1))
    assert type(features) is WRAPPERS[kind]
    assert len(moespec.moe_layers(features)) == LAYERS[kind]
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    outputs = features(x)
    assert [tuple(o.shape) for o in outputs] == SHAPES[kind]
    assert features.feature_info.channels() == [s[1] for s in SHAPES[kind]]
    aux = moespec.aux_loss(features)
    assert aux > 0
    sum(o.square().mean() for o in outputs).backward()  # a detection head's loss; no moespec call
    in_backward = _router_grads(features)

    # the same gradients as the task loss plus moespec.aux_loss, the way a loop that adds it would train
    layers = moespec.moe_layers(features).values()
    for layer in layers:
        layer.aux_loss_in_backward = False
    features.zero_grad()
    outputs = features(x)
    (sum(o.square().mean() for o in outputs) + moespec.aux_loss(features)).backward()
    added = _router_grads(features)
    assert in_backward.keys() == added.keys() and len(added) >= LAYERS[kind]
    for key in added:
        torch.testing.assert_close(in_backward[key], added[key])
    features.zero_grad()
    sum(o.square().mean() for o in features(x)).backward()
    assert any((_router_grads(features)[key] - added[key]).abs().max() > 1e-6 for key in added)  # aux: not nothing


@pytest.mark.parametrize("document", [VIT, CONVNEXT], ids=["vit", "convnext"])
def test_forward_intermediates_runs_the_moe_layers(document):
    model = timm.create_model(moespec.register_timm(moespec.load_spec(document), name="moespec_test_intermediates"))
    final, intermediates = model.forward_intermediates(torch.randn(2, 3, 32, 32), indices=2)
    assert len(intermediates) == 2 and final.shape[0] == 2
    assert moespec.aux_loss(model) > 0 and all(layer.last_routing is not None
                                               for layer in moespec.moe_layers(model).values())


def test_a_hub_folder_gives_a_feature_backbone_with_its_weights(tmp_path):
    model = moespec.create_model(moespec.load_spec(VIT), seed=3).eval()
    save_for_hf(model, tmp_path / "hub", safe_serialization=True)
    features = timm.create_model(f"local-dir:{tmp_path / 'hub'}", pretrained=True, features_only=True,
                                 out_indices=(0, 1)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model.forward_intermediates(x, indices=(0, 1), intermediates_only=True)
        for got, want in zip(features(x), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)

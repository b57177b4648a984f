"""moespec.densify: a freshly upcycled model densifies into the dense model it came from, logit for logit (plain,
channels-last, gated FFNs, and TinyViT's with a `pre` norm); the result is the plain timm model (strict load);
shared experts fold in where the dense FFN has room."""

from __future__ import annotations

import pytest
import timm
import torch
from safetensors.torch import save_file

import moespec
from moespec.compress import densify, densify_with_report
from moespec.errors import MoespecError

from .conftest import tiny_spec

EVA = {"model": "eva02_tiny_patch14_224", "kwargs": {"depth": 2, "img_size": 28, "num_classes": 10}}  # GluMlp
TINY_VIT = {"model": "tiny_vit_5m_224", "kwargs": {"depths": [1, 1, 1, 1], "num_classes": 10}}  # NormMlp: pre
CONVNEXT = {"model": "convnext_tiny", "kwargs": {"depths": [1, 1, 1, 1], "dims": [16, 32, 48, 64], "num_classes": 10}}


def dense_and_upcycled(tmp_path, spec: moespec.Spec):
    """The dense timm model of `spec`'s backbone (seeded, its norms and biases drawn too, so that nothing is
    trivially 0 or 1) and the MoE model upcycled from it."""
    torch.manual_seed(0)
    dense = timm.create_model(spec.backbone.model, **spec.backbone.kwargs)
    with torch.no_grad():
        for name, tensor in dense.named_parameters():
            if tensor.dim() == 1:
                tensor.normal_(mean=1.0 if name.endswith("weight") else 0.0, std=0.1)
    save_file(dense.state_dict(), str(tmp_path / "dense.safetensors"))
    return dense.eval(), moespec.upcycle(spec, tmp_path / "dense.safetensors")


@pytest.mark.parametrize("backbone", ["vit", "convnext", "eva", pytest.param("tinyvit", marks=pytest.mark.slow)])
def test_densifying_a_freshly_upcycled_model_gives_the_dense_model(tmp_path, images, backbone):
    spec = tiny_spec(experts=4, top_k=2, normalize=True)
    if backbone != "vit":
        side = {"convnext": 32, "eva": 28, "tinyvit": 64}[backbone]
        images = torch.randn(2, 3, side, side) if side > 32 else images[..., :side, :side]
        backbone = {"convnext": CONVNEXT, "eva": EVA, "tinyvit": TINY_VIT}[backbone]
        spec = moespec.load_spec({"backbone": backbone, "input_size": [3, side, side],
                                  "moe": [{"where": {"last": 2}, "experts": 4,
                                           "router": {"top_k": 2, "normalize": True}}]})
    dense, upcycled = dense_and_upcycled(tmp_path, spec)
    result = densify(upcycled.eval())
    assert type(result) is type(dense) and result.moespec_spec.moe == []
    assert torch.allclose(result.eval()(images), dense(images), rtol=0, atol=1e-5)
    plain = timm.create_model(spec.backbone.model, **spec.backbone.kwargs)
    plain.load_state_dict(result.state_dict(), strict=True)
    assert torch.equal(plain.eval()(images), result(images))


def test_without_normalization_the_combine_mass_is_measured_and_folded(tmp_path, images):
    """Unnormalized top-2 of 4 scales an upcycled layer's FFN by the kept gate mass (< 1): densify with images
    folds the mean mass into fc2, so the dense FFN is mass * FFN (here checked on the layer's own output)."""
    spec = tiny_spec(experts=4, top_k=2, normalize=False)
    dense, upcycled = dense_and_upcycled(tmp_path, spec)
    result, report = densify_with_report(upcycled.eval(), images)
    mass = float(report.notes[1].split("mass ")[1].split()[0])
    assert 0.5 <= mass < 1.0
    ffn = dense.blocks[1].mlp
    assert torch.allclose(result.blocks[1].mlp.fc2.weight, ffn.fc2.weight * mass, rtol=1e-4, atol=1e-6)
    assert torch.allclose(result.blocks[1].mlp.fc1.weight, ffn.fc1.weight)


def test_shared_experts_fold_in_beside_narrower_routed_experts(tmp_path, images):
    """Routed and shared experts of half the dense width: the dense FFN holds the routed one in its first half
    and the shared one in its second, and computes their sum, which is the MoE layer's output (identical routed
    experts, normalized top-k)."""
    spec = tiny_spec(experts=2, top_k=1, normalize=True, expert_hidden=192, shared_experts=1)
    model = moespec.create_model(spec, seed=0).eval()
    bank = model.blocks[1].mlp.experts
    with torch.no_grad():
        for tensor in (bank.fc1.weight, bank.fc1.bias, bank.fc2.weight, bank.fc2.bias):
            tensor[1] = tensor[0]
        model.blocks[1].mlp.shared.fc2.bias.normal_()
    result = densify(model)
    assert torch.allclose(result.eval()(images), model(images), rtol=0, atol=1e-5)


def test_shared_experts_that_do_not_fit_are_one_clear_error(tmp_path, images):
    model = moespec.create_model(tiny_spec(experts=2, top_k=1, shared_experts=1), seed=0)
    with pytest.raises(MoespecError, match=r"densify: blocks.1.mlp: 1 shared expert\(s\) of 384 hidden units beside "
                                           r"the routed experts' 384 hidden units do not fit the dense FFN's 384"):
        densify(model)


def test_top_keeps_the_most_used_expert(images):
    model = moespec.create_model(tiny_spec(experts=4, top_k=1, normalize=True), seed=0).eval()
    result, report = densify_with_report(model, images, how="top")
    top = max(range(4), key=lambda e: report.layers[0].load_before[e])
    assert torch.equal(result.blocks[1].mlp.fc1.weight, model.blocks[1].mlp.experts.fc1.weight[top])
    with pytest.raises(MoespecError, match="how=top keeps the most used expert, which needs images"):
        densify(model, how="top")

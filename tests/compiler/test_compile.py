"""The fx compiler: exact dense equivalence, every timm FFN family, and a real training step."""

from __future__ import annotations

import pytest
import timm
import torch
from torch import fx

import moespec
from moespec.backbones import create_backbone
from moespec.compiler import compile_graph, compile_model
from moespec.layers import MoE

from ..conftest import SPECS_DIR, TINY_CONVNEXT, TINY_INPUT, TINY_VIT, make_spec, quick_first, randomize


@pytest.mark.parametrize("backbone", [TINY_VIT, TINY_CONVNEXT], ids=["vit", "convnext"])
def test_no_moe_compiles_to_exactly_the_eager_model(backbone):
    spec = make_spec(backbone, [])
    model = moespec.create_model(spec).eval()
    eager = timm.create_model(backbone["model"], **backbone["kwargs"]).eval()
    eager.load_state_dict(model.state_dict())
    randomize(eager)
    model.load_state_dict(eager.state_dict())
    x = torch.randn(2, *TINY_INPUT)
    assert type(model) is type(eager)
    assert torch.equal(model(x), eager(x))


# (timm model, kwargs, sublayer, expected FFN family, input size)
FAMILIES = {
    "vit-Mlp": ("vit_small_patch16_224", {"depth": 2, "img_size": 32}, "mlp", "Mlp", [3, 32, 32]),
    "deit3": ("deit3_small_patch16_224", {"depth": 2, "img_size": 32}, "mlp", "Mlp", [3, 32, 32]),
    "dinov2": ("vit_small_patch14_dinov2", {"depth": 2, "img_size": 28}, "mlp", "Mlp", [3, 28, 28]),
    "vit-SwiGLUPacked": ("vit_small_patch16_224", {"depth": 2, "img_size": 32, "mlp_layer": "swiglu"}, "mlp",
                         "GluMlp", [3, 32, 32]),
    "eva-SwiGLU": ("eva02_tiny_patch14_224", {"depth": 2, "img_size": 28, "scale_mlp": True}, "mlp", "SwiGLU",
                   [3, 28, 28]),
    "convnext": ("convnext_tiny", {"depths": (1, 1, 2, 1)}, "mlp", "Mlp", [3, 64, 64]),
    "convnext-conv_mlp": ("convnext_tiny", {"depths": (1, 1, 2, 1), "conv_mlp": True}, "mlp", "Mlp", [3, 64, 64]),
    "convnextv2-GRN": ("convnextv2_atto", {"depths": (1, 1, 2, 1)}, "mlp", "GlobalResponseNormMlp", [3, 64, 64]),
    "mixer-tokens": ("mixer_s32_224", {"img_size": 64}, "mlp_tokens", "Mlp", [3, 64, 64]),
    "mixer-channels": ("mixer_s32_224", {"img_size": 64}, "mlp_channels", "Mlp", [3, 64, 64]),
    "ConvMlp": ("moespec_test_convmlp_net", {}, "mlp", "ConvMlp", [3, 32, 32]),
}


# the quick run leaves out ConvNeXt's channels-first FFN (covered quick by tests/layers/test_routing_groups.py)
# and Mixer's channel MLP (timm's Mlp on tokens, as ViT's): CI runs them
FAMILIES_QUICK_FIRST = quick_first(list(FAMILIES), set(FAMILIES) - {"convnext-conv_mlp", "mixer-channels"})


def _family_spec(case: str, experts=4, top_k=4, normalize=True) -> moespec.Spec:
    model, kwargs, sublayer, _, size = FAMILIES[case]
    if kwargs.get("mlp_layer") == "swiglu":
        kwargs = {**kwargs, "mlp_layer": timm.layers.SwiGLUPacked}
    return moespec.load_spec({
        "name": case, "backbone": {"model": model, "kwargs": kwargs}, "input_size": size,
        "moe": [{"where": {"last": 1}, "sublayer": sublayer, "experts": experts, "top_k": top_k, "shared_experts": 1,
                 "router": {"normalize": normalize}}],
    })


@pytest.mark.parametrize("case", FAMILIES_QUICK_FIRST)
def test_every_ffn_family_compiles_trains_and_upcycles_exactly(case, tmp_path):
    """Each family: a training step works, and with k = E and normalized gates the upcycled model is the
    dense model (each shared expert is removed for the equivalence, since it adds a second FFN)."""
    spec = _family_spec(case)
    plan = moespec.plan(spec)
    assert [layer.family for layer in plan.layers] == [FAMILIES[case][3]]

    model = randomize(moespec.create_model(spec)).train()  # timm zero-inits some heads: no gradient to check
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, *spec.input_size)
    loss = model(x).square().mean() + moespec.aux_loss(model)
    loss.backward()
    optimizer.step()
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert moe.router.gate.weight.grad.abs().sum() > 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items() if ".experts." in k)

    no_shared = spec.model_copy(update={"moe": [spec.moe[0].model_copy(update={"shared_experts": 0})]})
    dense = randomize(timm.create_model(spec.backbone.model, **spec.backbone.kwargs)).eval()
    path = tmp_path / "dense.pth"
    torch.save(dense.state_dict(), path)
    upcycled = moespec.upcycle(no_shared, path).eval()
    with torch.no_grad():
        torch.testing.assert_close(upcycled(x), dense(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", FAMILIES_QUICK_FIRST)
def test_the_fx_rewrite_and_the_returned_timm_model_compute_the_same_function(case):
    """compile_model installs exactly the modules that the fx passes swapped at their call sites: with the
    same seed, the rewritten graph and the returned timm model are the same function."""
    spec = _family_spec(case, experts=4, top_k=2)
    dense = randomize(create_backbone(spec))
    plan = moespec.plan(spec)
    torch.manual_seed(0)
    graph = compile_graph(dense, plan)
    torch.manual_seed(0)
    model = compile_model(dense, plan)
    assert isinstance(graph, fx.GraphModule) and type(model) is type(dense)
    assert not moespec.moe_layers(dense)  # the dense model is left as it was
    assert moespec.moe_layers(model).keys() == {layer.path for layer in plan.layers}
    x = torch.randn(2, *spec.input_size)
    with torch.no_grad():
        assert torch.equal(graph.eval()(x), model.eval()(x))


def test_compiled_model_keeps_state_dict_names_and_timm_attributes():
    spec = make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 4, "top_k": 2}])
    model = moespec.create_model(spec)
    keys = set(model.state_dict())
    assert "blocks.1.mlp.experts.fc1.weight" in keys and "blocks.1.mlp.router.gate.weight" in keys
    assert "blocks.0.mlp.fc1.weight" in keys and "blocks.1.mlp.fc1.weight" not in keys
    assert model.state_dict()["blocks.1.mlp.experts.fc1.weight"].shape == (4, 1536, 384)
    assert model.pretrained_cfg["input_size"] == (3, 224, 224)
    assert model.num_classes == 10
    assert list(moespec.moe_layers(model)) == ["blocks.1.mlp"]


def test_train_and_eval_modes_are_not_frozen_into_the_graph():
    """Dropout / drop-path run as leaf modules, so eval() makes the model deterministic again."""
    spec = make_spec({**TINY_VIT, "kwargs": {**TINY_VIT["kwargs"], "drop_rate": 0.5, "drop_path_rate": 0.5}},
                     [{"where": {"last": 1}, "experts": 2}])
    model = moespec.create_model(spec)
    x = torch.randn(2, *TINY_INPUT)
    model.train()
    assert not torch.equal(model(x), model(x))
    model.eval()
    assert torch.equal(model(x), model(x))


def test_meta_build_has_no_storage():
    spec = moespec.load_spec(str(SPECS_DIR / "vit_s16_moe8_every2_top2.yaml"))
    model = moespec.create_model(spec, device="meta")
    assert all(p.is_meta for p in model.parameters())

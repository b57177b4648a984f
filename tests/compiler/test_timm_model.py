"""A compiled model is the backbone's own timm class: its methods agree with the dense model's, timm's
optimizer factory groups its parameters as the dense model's, and gradient checkpointing keeps the aux loss."""

from __future__ import annotations

import copy
import gc
import pickle
import re
import weakref

import pytest
import timm
import torch
from timm.models.convnext import ConvNeXt
from timm.models.vision_transformer import VisionTransformer
from timm.optim import create_optimizer_v2, param_groups_layer_decay

import moespec
from moespec.backbones import create_backbone
from moespec.compiler import NoWeightDecay, compile_model, plan_of
from moespec.errors import MoespecError
from moespec.layers import MoE
from moespec.planning import plan_for

from ..conftest import TINY_CONVNEXT, TINY_INPUT, TINY_VIT, make_spec, randomize
from .test_sparse_mlp import SMALL

EVERY_BLOCK = [{"where": {"every": 1}, "experts": 4, "top_k": 2}]
# eva02 with scale_mlp: a SwiGLU FFN with an inner LayerNorm, so experts carry stacked norm parameters
EVA = {"model": "eva02_tiny_patch14_224", "kwargs": {"depth": 2, "img_size": 28, "scale_mlp": True}}


def _pair(backbone: dict, moe=EVERY_BLOCK, input_size=TINY_INPUT, **top):
    """The MoE model and the dense timm model with the same non-FFN weights, both in eval mode."""
    spec = moespec.load_spec({"backbone": backbone, "input_size": list(input_size), "moe": moe, **top})
    model = randomize(moespec.create_model(spec, seed=0)).eval()
    dense = timm.create_model(backbone["model"], **backbone["kwargs"]).eval()
    dense.load_state_dict({k: v for k, v in model.state_dict().items() if k in dense.state_dict()}, strict=False)
    return model, dense


@pytest.mark.parametrize("backbone,cls", [(TINY_VIT, VisionTransformer), (TINY_CONVNEXT, ConvNeXt)],
                         ids=["vit", "convnext"])
def test_the_model_is_an_instance_of_the_timm_class_and_its_methods_agree(backbone, cls):
    model, dense = _pair(backbone)
    assert type(model) is cls
    x = torch.randn(2, *TINY_INPUT)
    with torch.no_grad():
        features = model.forward_features(x)
        assert features.shape == dense.forward_features(x).shape
        torch.testing.assert_close(model.forward_head(features), model(x))
        final, intermediates = model.forward_intermediates(x)
        assert final.shape == features.shape
        assert [t.shape for t in intermediates] == [t.shape for t in dense.forward_intermediates(x)[1]]
    blocks = model.blocks if cls is VisionTransformer else model.stages[2].blocks
    assert isinstance(blocks[1].mlp, MoE)
    assert model.group_matcher() == dense.group_matcher()
    assert model.get_classifier() is model.head if cls is VisionTransformer else model.head.fc
    model.reset_classifier(5)
    with torch.no_grad():
        assert model(x).shape == (2, 5)


def test_create_model_upcycle_and_load_return_training_mode_models(tmp_path):
    spec = make_spec(TINY_VIT, EVERY_BLOCK)
    model = moespec.create_model(spec)
    assert model.training
    assert moespec.upcycle(spec).training
    moespec.save(model, tmp_path / "m.safetensors")
    assert moespec.load(tmp_path / "m.safetensors").training


def test_the_model_holds_no_reference_to_itself_and_pickles():
    """What moespec adds to a timm model is plain data: its `no_weight_decay` is no method bound to the model
    (which made a reference cycle), so the model is freed as soon as it is dropped, with no cycle collection."""
    model = moespec.create_model(make_spec(TINY_VIT, EVERY_BLOCK))
    assert type(model.no_weight_decay) is NoWeightDecay
    names = model.no_weight_decay()
    assert {"pos_embed", "cls_token", "blocks.1.mlp.experts.fc1.bias", "blocks.1.mlp.experts.fc2.bias"} <= names
    twin = pickle.loads(pickle.dumps(model))
    assert twin.no_weight_decay() == copy.deepcopy(model).no_weight_decay() == names
    assert twin.moespec_spec == model.moespec_spec and twin.blocks[1].mlp.plan == model.blocks[1].mlp.plan
    gc.collect()
    gc.disable()
    try:
        dropped = [weakref.ref(x) for x in (model, *model.modules(), *model.parameters())]
        del model, twin
        assert not [ref for ref in dropped if ref() is not None]
    finally:
        gc.enable()


def test_compile_model_frees_the_graphs_it_traced():
    """compile_model keeps the swapped modules, not the fx tracer or graph modules (each in reference cycles):
    the dense model it compiled is freed once dropped, with no cycle collection. A rescale traces twice."""
    spec = moespec.load_spec({**SMALL, "moe": SMALL["moe"] + [{"where": {"first": 1}, "sublayer": "mlp_tokens",
                                                                "experts": 2, "top_k": 1}]})
    dense = create_backbone(spec)
    plan = plan_for(spec, dense)
    gc.collect()
    gc.disable()
    try:
        model = compile_model(dense, plan)
        dropped = [weakref.ref(x) for x in (dense, *dense.modules(), *dense.parameters())]
        kept = {id(x) for x in (*model.modules(), *model.parameters())}
        dropped = [ref for ref in dropped if id(ref()) not in kept]  # the FFNs and blocks replaced, and the root
        del dense
        assert len(dropped) > 10 and not [ref for ref in dropped if ref() is not None]
    finally:
        gc.enable()


def test_plan_of_a_model_is_the_plan_it_was_compiled_from_and_each_layer_carries_its_part(tmp_path):
    spec = make_spec(TINY_VIT, [{"where": {"last": 1}, "experts": 4, "top_k": 1}])
    model = moespec.create_model(spec)
    plan = plan_of(model)
    assert plan == moespec.plan(spec) and moespec.plan_of is plan_of
    assert [(path, layer.plan) for path, layer in moespec.moe_layers(model).items()] == [
        (layer.path, layer) for layer in plan.layers]
    moespec.save(model, tmp_path / "m.safetensors")
    assert plan_of(moespec.load(tmp_path / "m.safetensors")) == plan
    with pytest.raises(MoespecError, match="not built by moespec"):
        plan_of(compile_model(create_backbone(spec), plan))  # compile_model's caller holds the plan


def _counterpart(name: str, dense_names: list[str]) -> str:
    """The dense parameter an MoE parameter was stacked from: blocks.1.mlp.experts.fc1.bias -> blocks.1.mlp.fc1.bias
    (or fc1_g.bias, fc1_x.bias for SwiGLU's two input projections, which the experts pack into one fc1)."""
    prefix, rest = name.split(".experts.")
    layer, param = rest.split(".", 1)
    pattern = re.compile(rf"{re.escape(prefix)}\.{layer}(_\w+)?\.{param}$")
    return next(n for n in dense_names if pattern.match(n))


@pytest.mark.parametrize("backbone", [TINY_VIT, EVA, TINY_CONVNEXT], ids=["vit", "eva-swiglu-norm", "convnext"])
def test_timm_optimizer_groups_treat_experts_as_their_dense_ffn(backbone):
    input_size = (3, 28, 28) if backbone is EVA else TINY_INPUT
    model, dense = _pair(backbone, input_size=input_size)

    def decay_of(m):
        optimizer = create_optimizer_v2(m, "adamw", lr=1e-3, weight_decay=0.05)
        return {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}

    moe_decay, dense_decay = decay_of(model), decay_of(dense)
    dense_params = dict(dense.named_parameters())
    checked = 0
    for name, param in model.named_parameters():
        if ".experts." in name:
            expected = dense_decay[id(dense_params[_counterpart(name, list(dense_params))])]
            assert moe_decay[id(param)] == expected, name
            checked += 1
        elif ".router." in name:
            assert moe_decay[id(param)] == (0.05 if name.endswith("weight") else 0.0), name
        else:
            assert moe_decay[id(param)] == dense_decay[id(dense_params[name])], name
    assert checked >= 8
    if backbone is EVA:  # the experts' stacked LayerNorm does not decay, as the dense FFN's does not
        assert moe_decay[id(model.get_parameter("blocks.1.mlp.experts.norm.weight"))] == 0.0
    if backbone is TINY_VIT:
        assert moe_decay[id(model.pos_embed)] == 0.0 and moe_decay[id(model.cls_token)] == 0.0


def test_layer_decay_puts_experts_and_router_in_their_block():
    model, dense = _pair(TINY_VIT)

    def scale_of(m):
        groups = param_groups_layer_decay(m, weight_decay=0.05, layer_decay=0.5,
                                          no_weight_decay_list=m.no_weight_decay())
        return {id(p): (group["lr_scale"], group["weight_decay"]) for group in groups for p in group["params"]}

    moe, reference = scale_of(model), scale_of(dense)
    for block in (0, 1):
        dense_fc1 = reference[id(dense.get_parameter(f"blocks.{block}.mlp.fc1.weight"))]
        assert moe[id(model.get_parameter(f"blocks.{block}.mlp.experts.fc1.weight"))] == dense_fc1
        assert moe[id(model.get_parameter(f"blocks.{block}.mlp.router.gate.weight"))] == dense_fc1
        dense_bias = reference[id(dense.get_parameter(f"blocks.{block}.mlp.fc1.bias"))]
        assert moe[id(model.get_parameter(f"blocks.{block}.mlp.experts.fc1.bias"))] == dense_bias
    assert len({scale for scale, _ in moe.values()}) == len({scale for scale, _ in reference.values()}) == 4


@pytest.mark.parametrize("in_backward", [False, True], ids=["aux_loss", "aux_loss_in_backward"])
def test_gradient_checkpointing_keeps_the_aux_loss_and_its_gradients(in_backward):
    model, _ = _pair(TINY_VIT, aux_loss_in_backward=in_backward)
    model.train()
    x = torch.randn(2, *TINY_INPUT)

    def grads(checkpointing: bool):
        model.zero_grad()
        model.set_grad_checkpointing(checkpointing)
        out = model(x)
        aux = moespec.aux_loss(model)
        (out.square().mean() + aux).backward()
        return aux.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    aux_plain, plain = grads(False)
    aux_ckpt, ckpt = grads(True)
    assert model.grad_checkpointing
    torch.testing.assert_close(aux_ckpt, aux_plain)
    assert plain.keys() == ckpt.keys() and "blocks.1.mlp.router.gate.weight" in plain
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
    assert plain["blocks.1.mlp.router.gate.weight"].abs().sum() > 0

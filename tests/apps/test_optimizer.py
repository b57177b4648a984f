"""`moespec.optimizer_groups`: timm's parameter groups, with the routed experts at their own weight decay."""

from __future__ import annotations

import re

import pytest
import torch
from timm.optim import create_optimizer_v2
from timm.optim._param_groups import param_groups_layer_decay, param_groups_weight_decay

import moespec

from ..conftest import TINY_VIT, make_spec

MOE = [{"where": {"every": 2}, "experts": 4, "shared_experts": 1, "router": {"top_k": 2}}]
TINY_CONVNEXT_V2 = {"model": "convnextv2_atto", "kwargs": {"depths": (1, 1, 2, 1), "num_classes": 10}}


def _names(model, groups):
    """Each group as (its settings but params, the sorted names of its params)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [({k: v for k, v in g.items() if k != "params"}, sorted(names[id(p)] for p in g["params"]))
            for g in groups]


def _decay_of(model, groups):
    return {name: settings["weight_decay"] for settings, names in _names(model, groups) for name in names}


def test_without_an_expert_decay_the_groups_are_timms():
    model = moespec.create_model(make_spec(TINY_VIT, MOE))
    no_decay = model.no_weight_decay()
    assert _names(model, moespec.optimizer_groups(model, 0.05)) == \
        _names(model, param_groups_weight_decay(model, 0.05, no_weight_decay_list=no_decay))
    assert _names(model, moespec.optimizer_groups(model, 0.05, layer_decay=0.75)) == \
        _names(model, param_groups_layer_decay(model, 0.05, no_weight_decay_list=no_decay, layer_decay=0.75))
    # and the same as timm's own optimizer factory makes (which reads no_weight_decay() itself)
    timm_groups = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05).param_groups
    ours = create_optimizer_v2(moespec.optimizer_groups(model, 0.05), "adamw", lr=1e-3, weight_decay=0.05).param_groups
    assert [g["weight_decay"] for g in ours] == [g["weight_decay"] for g in timm_groups]
    assert [[id(p) for p in g["params"]] for g in ours] == [[id(p) for p in g["params"]] for g in timm_groups]


def test_routed_expert_weights_get_their_own_decay_and_nothing_else_changes():
    model = moespec.create_model(make_spec(TINY_VIT, MOE))
    timm_decay = _decay_of(model, param_groups_weight_decay(model, 0.05, no_weight_decay_list=model.no_weight_decay()))
    decay = _decay_of(model, moespec.optimizer_groups(model, 0.05, expert_weight_decay=0.2))
    assert decay.keys() == timm_decay.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    changed = {name for name in decay if decay[name] != timm_decay[name]}
    assert changed == {"blocks.1.mlp.experts.fc1.weight", "blocks.1.mlp.experts.fc2.weight"}
    assert all(decay[name] == 0.2 for name in changed)
    # biases, pos_embed / cls_token (no_weight_decay()), the router and the shared expert keep timm's decay
    assert decay["blocks.1.mlp.experts.fc1.bias"] == decay["pos_embed"] == decay["cls_token"] == 0.0
    assert decay["blocks.1.mlp.shared.fc1.weight"] == decay["blocks.1.attn.qkv.weight"] == 0.05
    assert any(decay[name] == 0.05 for name in decay if ".mlp.router." in name)
    torch.optim.AdamW(moespec.optimizer_groups(model, 0.05, expert_weight_decay=0.2), lr=1e-3)  # torch takes them


def test_experts_decay_when_nothing_else_does():
    """timm puts every parameter in one group at weight_decay 0; the experts' weights still decay."""
    model = moespec.create_model(make_spec(TINY_VIT, MOE))
    for layer_decay in (None, 0.75):
        decay = _decay_of(model, moespec.optimizer_groups(model, 0.0, expert_weight_decay=0.1,
                                                          layer_decay=layer_decay))
        assert {name for name, value in decay.items() if value} == {"blocks.1.mlp.experts.fc1.weight",
                                                                    "blocks.1.mlp.experts.fc2.weight"}
        assert decay["blocks.1.mlp.experts.fc1.weight"] == 0.1


def test_layer_decay_keeps_each_layers_lr_scale_for_its_experts():
    model = moespec.create_model(make_spec(TINY_VIT, MOE))
    groups = moespec.optimizer_groups(model, 0.05, expert_weight_decay=0.0, layer_decay=0.5)
    timm_groups = param_groups_layer_decay(model, 0.05, no_weight_decay_list=model.no_weight_decay(),
                                           layer_decay=0.5)
    scale = {name: settings["lr_scale"] for settings, names in _names(model, timm_groups) for name in names}
    for settings, names in _names(model, groups):
        assert all(settings["lr_scale"] == scale[name] for name in names)
        if any(".experts.fc" in name and name.endswith(".weight") for name in names):
            assert settings["weight_decay"] == 0.0 and all(".experts." in name for name in names)
    assert len(groups) == len(timm_groups) + 1  # one block with experts: its decayed group split in two


def test_an_experts_stacked_vectors_never_decay():
    """A GRN expert's weight / bias (`experts.norm`) are [E, H]: a vector per expert, like the dense GRN's [H],
    which timm does not decay (timm's layer-decay rule alone, ndim <= 1, would decay the stacks)."""
    model = moespec.create_model(make_spec(TINY_CONVNEXT_V2, [{"where": {"stage_last": 1}, "experts": 2}]))
    stacked = [n for n, p in model.named_parameters() if ".experts." in n and p.ndim == 2]
    assert "stages.3.blocks.0.mlp.experts.norm.weight" in stacked
    for layer_decay in (None, 0.75):
        decay = _decay_of(model, moespec.optimizer_groups(model, 0.05, expert_weight_decay=0.1,
                                                          layer_decay=layer_decay))
        assert all(decay[name] == 0.0 for name in stacked)
        assert {decay[n] for n, p in model.named_parameters() if ".experts." in n and p.ndim == 3} == {0.1}


@pytest.mark.parametrize("arguments, wrong", [
    ({"weight_decay": float("nan")}, "weight_decay is nan"),
    ({"weight_decay": -0.05}, "weight_decay is -0.05"),
    ({"weight_decay": float("inf")}, "weight_decay is inf"),
    ({"weight_decay": "0.05"}, "weight_decay is '0.05'"),
    ({"weight_decay": True}, "weight_decay is True"),
    ({"weight_decay": 0.05, "expert_weight_decay": float("nan")}, "expert_weight_decay is nan"),
    ({"weight_decay": 0.05, "expert_weight_decay": -1}, "expert_weight_decay is -1"),
    ({"weight_decay": 0.05, "layer_decay": 0.0}, "layer_decay is 0.0"),
    ({"weight_decay": 0.05, "layer_decay": 1.5}, "layer_decay is 1.5"),
    ({"weight_decay": 0.05, "layer_decay": float("nan")}, "layer_decay is nan"),
])
def test_decays_that_are_not_finite_numbers_in_range_are_refused(arguments, wrong):
    """optimizer_groups took NaN, negative, infinite and string decays; one AdamW step then left non-finite
    weights."""
    model = moespec.create_model(make_spec(TINY_VIT, MOE))
    with pytest.raises(moespec.MoespecError, match=rf"^optimizer_groups: {re.escape(wrong)}; allowed: "):
        moespec.optimizer_groups(model, **arguments)


def test_an_adamw_step_at_a_valid_decay_keeps_the_weights_finite():
    model = moespec.create_model(make_spec(TINY_VIT, MOE))
    optimizer = torch.optim.AdamW(moespec.optimizer_groups(model, 0.05, expert_weight_decay=0.0, layer_decay=1.0))
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())

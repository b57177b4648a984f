"""The table of expert steps (`moespec.layers.steps`, issue 45 points 2 and 3): one way to force a step, on a
model, a layer or a bank, by name; an unknown name says which exist; the step is chosen once per layer call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import moespec
from moespec.layers import EXPERT_STEPS, Experts, LinearGate, MoE, TopKRouter, set_expert_step
from moespec.layers import steps as steps_module
from moespec.layers.steps import STEPS, available_steps

from ..conftest import TINY_VIT, make_spec

DIM = 16


def _layer(experts: int = 4, top_k: int = 2) -> MoE:
    torch.manual_seed(0)
    return MoE(TopKRouter(LinearGate(DIM, experts), experts, top_k), Experts(experts, DIM, 2 * DIM, DIM, act=nn.GELU()))


def test_an_unknown_step_names_the_steps():
    with pytest.raises(ValueError, match=r"unknown expert step 'grouped'; the steps are: auto, loop, padded, "
                                         r"grouped_mm, triton"):
        set_expert_step(_layer(), "grouped")
    assert EXPERT_STEPS == ("loop", "padded", "grouped_mm", "triton")


@pytest.mark.parametrize("step", available_steps())
def test_a_forced_step_runs_and_auto_restores_the_rule(step, monkeypatch):
    """Every bank of a container takes the step; each call runs it (counted at each step's `run`), and "auto"
    makes the rule pick again."""
    model = nn.Sequential(_layer(), _layer(experts=2, top_k=1))
    ran = []
    for name, runner in STEPS.items():
        monkeypatch.setattr(runner, "run", lambda *a, _name=name, _run=runner.run: ran.append(_name) or _run(*a))
    x = torch.randn(2, 5, DIM)
    assert set_expert_step(model, step) is model
    assert [m.experts.step for m in model] == [step, step]
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            model(x)
    assert set(ran) <= {step}  # the segment-by-segment combine of the loop and the fused ones run no `run`
    set_expert_step(model, "auto")
    assert [m.experts.step for m in model] == ["auto", "auto"]


def test_the_step_is_chosen_once_per_layer_call(monkeypatch):
    """The rule runs once per layer call, with and without autograd (it ran 2-3 times on CPU)."""
    calls = []
    rule = steps_module.auto_step
    monkeypatch.setattr(steps_module, "auto_step", lambda *a, **k: calls.append(1) or rule(*a, **k))
    layer, x = _layer(), torch.randn(2, 5, DIM)
    with torch.no_grad():
        layer(x)
    assert len(calls) == 1
    layer(x).sum().backward()
    assert len(calls) == 2


def test_create_model_takes_the_step_and_refuses_an_unknown_one():
    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4, "top_k": 2}])
    model = moespec.create_model(spec, expert_step="padded")
    banks = [m for m in model.modules() if isinstance(m, Experts)]
    assert banks and all(bank.step == "padded" for bank in banks)
    with pytest.raises(ValueError, match="the steps are"):
        moespec.create_model(spec, expert_step="fast")


def test_the_old_attribute_still_forces_a_step_and_warns():
    """Scripts of release 0.1 (the shared GPU check among them) assign `experts.dispatch`: it still forces the
    step, through the same check, with a DeprecationWarning."""
    layer = _layer()
    with pytest.warns(DeprecationWarning, match="set_expert_step"):
        layer.experts.dispatch = "padded"
    assert layer.experts.step == "padded" and layer.experts.dispatch == "padded"
    with pytest.raises(ValueError, match="the steps are"), pytest.warns(DeprecationWarning):
        layer.experts.dispatch = "fast"

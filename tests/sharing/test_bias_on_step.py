"""The balancing bias moves once per optimizer step without a call in the loop (issue 48, point 4), once only
where the loop also calls moespec, never for an optimizer that does not hold the model, and a loop whose
forwards go on without any step is told so once."""

from __future__ import annotations

import warnings

import pytest
import torch

import moespec
from moespec.layers import balancing

RATE = 2.0**-6  # a power of two: the biases are exact sums of +-RATE
SPEC = {"name": "bias", "input_size": [3, 32, 32],
        "backbone": {"model": "vit_small_patch16_224",
                     "kwargs": {"depth": 2, "embed_dim": 32, "num_heads": 2, "img_size": 32, "patch_size": 8}},
        "moe": [{"where": {"every": 1}, "experts": 4, "aux_loss": [],
                 "router": {"kind": "topk", "top_k": 1, "bias_balance": {"rate": RATE}}}]}


def _model():
    return moespec.create_model(moespec.load_spec(SPEC), seed=0)


def _biases(model) -> list[torch.Tensor]:
    return [layer.router.balance.expert_bias.clone() for layer in moespec.moe_layers(model).values()]


def _train(model, optimizer, steps: int, accumulation: int, after_step=lambda: None) -> list[list[torch.Tensor]]:
    """A plain loop (no moespec call); returns, per step, each layer's summed loads over its micro-batches."""
    generator = torch.Generator().manual_seed(0)
    loads = []
    for _ in range(steps):
        step_loads = None
        for _ in range(accumulation):
            (model(torch.randn(2, 3, 32, 32, generator=generator)).square().mean() / accumulation).backward()
            counts = [layer.last_routing.counts.double() for layer in moespec.moe_layers(model).values()]
            step_loads = counts if step_loads is None else [a + b for a, b in zip(step_loads, counts, strict=True)]
        optimizer.step()
        optimizer.zero_grad()
        after_step()
        loads.append(step_loads)
    return loads


@pytest.mark.parametrize("accumulation", [1, 3])
def test_each_optimizer_step_moves_the_bias_once_on_all_its_micro_batches(accumulation):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    history = [_biases(model)]
    loads = _train(model, optimizer, steps=4, accumulation=accumulation,
                   after_step=lambda: history.append(_biases(model)))
    for step, step_loads in enumerate(loads):
        for before, after, load in zip(history[step], history[step + 1], step_loads, strict=True):
            # DeepSeek-V3: expert_bias += rate * sign(mean load - load), by hand
            expected = before + RATE * torch.sign(load.mean() - load).float()
            torch.testing.assert_close(after, expected, rtol=0, atol=0)
    assert all(any((a != b).any() for a, b in zip(before, after, strict=True))  # it moved at every step
               for before, after in zip(history, history[1:], strict=False))


def test_a_loop_that_also_calls_moespec_moves_it_once_per_step():
    once, twice = _model(), _model()
    optimizer = torch.optim.SGD(once.parameters(), lr=0.0)
    _train(once, optimizer, steps=3, accumulation=2)
    hooked = torch.optim.SGD(twice.parameters(), lr=0.0)
    moespec.update_bias_on_step(twice, hooked)  # the loop's own hook: the automatic step leaves the model
    _train(twice, hooked, steps=3, accumulation=2)
    for a, b in zip(_biases(once), _biases(twice), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    manual = _model()
    optimizer = torch.optim.SGD(manual.parameters(), lr=0.0)
    _train(manual, optimizer, steps=3, accumulation=2, after_step=lambda: moespec.update_bias(manual))
    for a, b in zip(_biases(once), _biases(manual), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_another_models_optimizer_leaves_the_bias_and_a_loop_without_steps_is_warned(monkeypatch):
    model, other = _model(), torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    monkeypatch.setattr(balancing, "FORWARDS_WITHOUT_STEP", 5)
    monkeypatch.setattr(balancing.BIAS_ON_STEP, "warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(8):  # past FORWARDS_WITHOUT_STEP training forwards of each layer
            model(torch.randn(2, 3, 32, 32))
            other(torch.randn(1, 2)).sum().backward()
            optimizer.step()
    assert all(bias.abs().sum() == 0 for bias in _biases(model))
    assert [str(w.message) for w in caught if "update_bias_on_step" in str(w.message)] != []
    assert sum("update_bias_on_step" in str(w.message) for w in caught) == 1  # once

"""Eval-time overrides of the top-k router (`eval_top_k`, `eval_capacity_factor`): the routing in eval mode, and
`moespec stats`'s training and eval figures side by side when they differ."""

from __future__ import annotations

import csv
import io

import pytest
import torch
from torch import nn

import moespec
from moespec.counting import render
from moespec.layers import LinearGate, TopKRouter

from ..conftest import TINY_VIT, make_spec


def _router(**options) -> TopKRouter:
    torch.manual_seed(0)
    return TopKRouter(LinearGate(6, 4), 4, 2, **options)


def test_eval_top_k_routes_with_its_own_k_in_eval_only():
    router, x = _router(eval_top_k=1), torch.randn(10, 6)
    assert router.train()(x).counts.sum().item() == 20  # 10 items x k = 2
    assert router.eval()(x).counts.sum().item() == 10  # 10 items x eval k = 1
    assert router.experts_per_item(10, 1) == 1
    assert router.train().experts_per_item(10, 1) == 2


@pytest.mark.parametrize(("eval_capacity", "eval_kept"), [(2.0, 20), (None, 20), ("training", 4)])
def test_eval_capacity_factor_sets_the_eval_capacity(eval_capacity, eval_kept):
    """c = 0.25, k = 2, 10 items, 4 experts: ceil(0.25 * 2 * 10 / 4) = 2 pairs per expert, 8 at most; every item
    sends both choices to expert 0 and 1 (the gate below), so 4 pairs are kept. In eval, c = 2 takes all 20 (cap
    10 per expert), dropless (None) all 20, and "training" keeps c = 0.25."""
    router = _router(capacity_factor=0.25, eval_capacity_factor=eval_capacity)
    with torch.no_grad():
        router.gate.weight.zero_()
        router.gate.weight[0, 0] = router.gate.weight[1, 0] = 1.0
    x = torch.zeros(10, 6)
    x[:, 0] = 5.0
    assert router.train()(x).counts.sum().item() == 4
    assert router.eval()(x).counts.sum().item() == eval_kept


def test_stats_reports_training_and_eval_figures_when_they_differ():
    """Tiny ViT (dim 384, MLP 1536): one expert has 384 * 1536 + 1536 + 1536 * 384 + 384 = 1,181,568 params. With
    top_k 2 and eval_top_k 1, one fewer expert is active per token in eval, in each of the 2 MoE layers."""
    base = [{"where": {"every": 1}, "experts": 4, "router": {"kind": "topk", "top_k": 2}}]
    plain = moespec.stats(make_spec(TINY_VIT, base))
    assert plain.eval_activated_params is None and plain.eval_gmacs is None
    assert all(layer.eval_top_k is None for layer in plain.layers)
    assert "eval" not in render([plain], "csv").splitlines()[0]

    overridden = [{**base[0], "router": {**base[0]["router"], "eval_top_k": 1}}]
    record = moespec.stats(make_spec(TINY_VIT, overridden))
    expert = 384 * 1536 + 1536 + 1536 * 384 + 384
    assert record.activated_params == plain.activated_params
    assert record.eval_activated_params == plain.activated_params - 2 * expert
    # per token and layer, one expert's MACs (384 * 1536 * 2) and the combine (384) fewer; 17 tokens per image
    assert record.eval_gmacs * 1e9 == pytest.approx(plain.gmacs * 1e9 - 2 * 17 * (2 * 384 * 1536 + 384))
    assert [layer.eval_top_k for layer in record.layers] == [1, 1]
    assert [layer.router for layer in record.layers] == ["topk/linear eval-k=1"] * 2  # in --format json
    rows = list(csv.reader(io.StringIO(render([record], "csv"))))
    assert rows[0][-2:] == ["eval activated (M)", "eval GMACs"]
    assert rows[1][-2:] == [f"{record.eval_activated_params / 1e6:.2f}", f"{record.eval_gmacs:.3f}"]
    layer_rows = list(csv.reader(io.StringIO(render([record], "csv", per_layer=True))))
    assert layer_rows[0][-3:] == ["eval k", "eval activated (M)", "eval GMACs"]
    assert layer_rows[1][-3] == "1" and layer_rows[-1][-3:] == ["-", "-", "-"]  # the dense remainder


def test_stats_reports_the_eval_capacity():
    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4, "router": {
        "kind": "topk", "top_k": 1, "capacity_factor": 1.0, "eval_capacity_factor": 2.0}}])
    record = moespec.stats(spec)
    layer = record.layers[0]
    # executed: E * ceil(c * k * 17 / E) expert rows: c = 1 -> 4 * 5 = 20, c = 2 -> 4 * 9 = 36 rows
    per_row = (2 * 384 * 1536 + 384) / 1e9
    assert layer.eval_executed_gmacs - layer.executed_gmacs == pytest.approx((36 - 20) * per_row)
    dropless = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4, "router": {
        "kind": "topk", "top_k": 1, "capacity_factor": 1.0, "eval_capacity_factor": "dropless"}}])
    assert moespec.stats(dropless).layers[0].eval_executed_gmacs is None


def test_plan_and_stats_keep_the_training_k_in_the_k_column():
    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4, "router": {"kind": "topk", "top_k": 2,
                                                                                 "eval_top_k": 1}}])
    assert [layer.top_k for layer in moespec.stats(spec).layers] == [2, 2]
    assert "eval-k=1" in str(moespec.plan(spec))


def test_the_upcycled_model_routes_with_eval_top_k_in_eval():
    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4, "router": {"kind": "topk", "top_k": 2,
                                                                                 "eval_top_k": 1}}])
    model = moespec.create_model(spec)
    x = torch.randn(2, 3, 64, 64)
    model.eval()(x)
    layer = next(iter(moespec.moe_layers(model).values()))
    assert layer.last_routing.counts.sum().item() == 2 * 17
    model.train()(x)
    assert layer.last_routing.counts.sum().item() == 2 * 17 * 2
    assert isinstance(layer.router, nn.Module)

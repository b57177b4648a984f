"""The MoE layer on hand-made inputs: dispatch, capacity, shared experts, layouts, aux losses, gradients."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moespec.layers import Experts, LinearGate, MoE, Routing, SoftMoE, TopKRouter, set_expert_step
from moespec.layers.moe import aux_loss
from moespec.layers.routing import importance_load_loss, switch_loss, z_loss
from moespec.layers.steps import available_steps


def _moe(dim=6, hidden=5, experts=4, top_k=2, normalize=False, shared=0, capacity_factor=None, seed=0):
    torch.manual_seed(seed)
    bank = Experts(experts, dim, hidden, dim, act=nn.GELU())
    for p in bank.parameters():
        nn.init.normal_(p, std=0.5)
    shared_bank = Experts(shared, dim, hidden, dim, act=nn.GELU()) if shared else None
    if shared_bank is not None:
        for p in shared_bank.parameters():
            nn.init.normal_(p, std=0.5)
    router = TopKRouter(LinearGate(dim, experts), experts, top_k, normalize=normalize, capacity_factor=capacity_factor)
    nn.init.normal_(router.gate.weight, std=1.0)
    return MoE(router, bank, shared_bank, aux_loss_weights={"importance_load": 0.01})


def _expert(bank: Experts, e: int, x: torch.Tensor) -> torch.Tensor:
    """Reference: expert e written out with plain F.linear on its slice of the stacked weights."""
    h = F.gelu(F.linear(x, bank.fc1.weight[e], bank.fc1.bias[e]))
    return F.linear(h, bank.fc2.weight[e], bank.fc2.bias[e])


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """y_t = sum_{i in TopK(g(x_t))} g_i(x_t) E_i(x_t), one item at a time (Shazeer et al. 2017)."""
    items = x.reshape(-1, x.shape[-1])
    probs = moe.router.gate(items).softmax(-1)
    out = torch.zeros_like(items)
    for t in range(items.shape[0]):
        values, chosen = probs[t].topk(moe.router.top_k)
        if moe.router.normalize:
            values = values / values.sum()
        for value, e in zip(values, chosen, strict=True):
            out[t] += value * _expert(moe.experts, int(e), items[t : t + 1])[0]
    return out.reshape(x.shape)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("dispatch", available_steps())
@pytest.mark.parametrize("experts,top_k,normalize", [(4, 1, False), (4, 2, False), (4, 2, True), (3, 3, True)])
def test_dispatch_matches_per_item_reference(experts, top_k, normalize, dispatch, grad):
    """With and without autograd (without it, the loop combines segment by segment)."""
    moe = _moe(dim=8, hidden=4, experts=experts, top_k=top_k, normalize=normalize).eval()  # grouped_mm: 16-byte rows
    set_expert_step(moe.experts, dispatch)
    x = torch.randn(2, 7, 8)
    with torch.set_grad_enabled(grad):
        y = moe(x)
    assert y.requires_grad == grad
    torch.testing.assert_close(y, _reference(moe, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dispatch", available_steps())
def test_every_step_runs_under_bfloat16_autocast_with_and_without_autograd(dispatch):
    """Under autocast the experts give bfloat16 and the routing weights stay float32: the output is the
    float32 reference to bfloat16 rounding, in training and in inference (the no-grad path scales in place
    only when that keeps the dtype: it once raised in index_add_)."""
    moe = _moe(dim=8, hidden=4, experts=4, top_k=2)
    set_expert_step(moe.experts, dispatch)
    x = torch.randn(2, 7, 8, requires_grad=True)
    reference = _reference(moe, x.detach())
    for grad in (False, True):
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
            y = moe(x)
        torch.testing.assert_close(y.float(), reference, atol=0.1, rtol=0.05)
    y.float().square().mean().backward()
    assert x.grad.isfinite().all() and moe.experts.fc1.weight.grad.abs().sum() > 0


def test_capacity_keeps_first_items_in_order_and_zeroes_dropped():
    moe = _moe(experts=4, top_k=1, capacity_factor=1.0).eval()
    with torch.no_grad():  # every item prefers expert 2
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[2] = 0
        moe.router.gate.weight[2, 0] = 50.0
    x = torch.randn(1, 10, 6)
    x[..., 0] = x[..., 0].abs() + 1  # positive feature 0 -> expert 2 wins for every item
    y = moe(x)
    capacity = math.ceil(1.0 * 1 * 10 / 4)  # ceil(c * k * T / E) = 3
    assert moe.router.capacity(10) == capacity
    kept = y[0, :capacity]
    expected = torch.stack([_expert(moe.experts, 2, x[0, t : t + 1])[0] for t in range(capacity)])
    weights = moe.router.gate(x[0, :capacity]).softmax(-1)[:, 2:3]
    torch.testing.assert_close(kept, expected * weights, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(y[0, capacity:]) == 0


def test_shared_experts_add_to_routed_output():
    moe = _moe(shared=2).eval()
    x = torch.randn(2, 5, 6)
    items = x.reshape(-1, 6)
    shared = sum(_expert(moe.shared, e, items) for e in range(2)).reshape(x.shape)
    routed_only = MoE(moe.router, moe.experts).eval()
    torch.testing.assert_close(moe(x), routed_only(x) + shared, atol=1e-5, rtol=1e-5)


def test_channels_first_layout_equals_channels_last():
    moe = _moe().eval()
    x = torch.randn(2, 6, 3, 4)  # [B, C, H, W]
    first = MoE(moe.router, moe.experts, channels_dim=1).eval()
    expected = moe(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    torch.testing.assert_close(first(x), expected)


def test_aux_losses_hand_computed():
    # 4 items, 2 experts; probs chosen by hand, top-1 routing.
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    top1 = probs.argmax(-1)
    load = torch.bincount(top1, minlength=2).float()
    routing = Routing(probs, probs.log(), torch.arange(4), load.long(), probs.max(-1).values, top1,
                      probs.max(-1).values, load, torch.ones(4, dtype=torch.bool))
    # importance = [2.6, 1.4]: mean 2, population var 0.36 -> CV^2 = 0.09
    # load (top-1 counts) = [3, 1]: mean 2, var 1 -> CV^2 = 0.25; L = (0.09 + 0.25) / 2 = 0.17
    assert importance_load_loss(routing).item() == pytest.approx(0.17, abs=1e-6)
    # switch: f = [0.75, 0.25], P = [0.65, 0.35]; E * sum f_i P_i = 2 * (0.4875 + 0.0875) = 1.15
    assert switch_loss(routing).item() == pytest.approx(1.15, abs=1e-6)
    # z-loss: logits = log(probs), so logsumexp = log(sum probs) = 0 for every item
    assert z_loss(routing).item() == pytest.approx(0.0, abs=1e-6)


def test_layer_records_last_forward_and_gradients_reach_gate_and_used_experts():
    moe = _moe(experts=4, top_k=2).train()
    x = torch.randn(2, 9, 6)
    y = moe(x)
    assert set(moe.aux_losses) == {"importance_load", "switch", "z_loss"}
    assert moe.last_items == 18 and moe.last_routing.item.shape == (36,)
    (y.square().mean() + moe.weighted_aux_loss()).backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0
    used = [e for e, count in enumerate(moe.last_routing.counts.tolist()) if count > 0]
    for e in range(4):
        grad = moe.experts.fc1.weight.grad[e].abs().sum()
        assert (grad > 0) == (e in used)


@pytest.mark.parametrize("dispatch", ["loop", "padded"])
def test_frozen_experts_still_pass_the_task_gradient_to_the_router(dispatch):
    """Experts frozen and an input that needs no gradient: the bank records nothing, so under the loop it combines
    segment by segment, and the gate values, which do need a gradient, still carry the task loss's gradient to
    the router, as the per-item reference does."""
    moe = _moe(dim=8, hidden=4, experts=4, top_k=2).eval()
    moe.experts.requires_grad_(False)
    set_expert_step(moe.experts, dispatch)
    x = torch.randn(2, 5, 8)
    moe(x).square().sum().backward()
    got = moe.router.gate.weight.grad.clone()
    moe.zero_grad()
    _reference(moe, x).square().sum().backward()
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, moe.router.gate.weight.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("soft", [False, True], ids=["moe", "soft_moe"])
def test_a_layer_copies_and_pickles_after_a_forward_without_its_last_forward(soft):
    """An EMA or a kept best model is a deep copy taken mid-training; the last forward's records hold its graph,
    which deepcopy refuses. The copy starts with empty records and computes the same function."""
    layer = SoftMoE(Experts(4, 6, 5, 6, act=nn.GELU())) if soft else _moe()
    x = torch.randn(2, 9, 6)
    y = layer(x)
    y.square().mean().backward()
    twin = copy.deepcopy(layer)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (twin, loaded):
        assert other.last_items == 0 and not other.aux_losses
        assert (other.last_dispatch if soft else other.last_routing) is None
        assert torch.equal(other(x), y.detach())
    assert layer.last_items == 18  # the original keeps its own


def test_activated_macs_count_router_k_experts_combine_and_shared():
    moe = _moe(dim=6, hidden=5, experts=4, top_k=2, shared=1)
    # per item: router 6*4 + k=2 experts of (6*5 + 5*6) + combine k*6 + 1 shared expert of (6*5 + 5*6)
    assert moe.activated_macs(10, 2) == 10 * (24 + 2 * 60 + 2 * 6 + 60)


def test_executed_macs_pad_every_expert_to_capacity():
    moe = _moe(dim=6, hidden=5, experts=4, top_k=2, capacity_factor=1.5)
    capacity = math.ceil(1.5 * 2 * 10 / 4)  # 8 rows per expert for 10 items
    # router on every item + 4 experts x 8 rows x (expert 60 + combine 6)
    assert moe.executed_macs(10, 1) == 10 * 24 + 4 * capacity * (60 + 6)
    assert _moe(capacity_factor=None).executed_macs(10, 1) is None


def test_aux_loss_autoscaler_adds_the_aux_gradient_in_backward():
    """AuxLossAutoScaler: identity forward; backward gives the aux loss the gradient `scale`, as if
    `scale * aux` had been added to the loss."""
    from moespec.layers.moe import AuxLossAutoScaler

    w = torch.randn(5, requires_grad=True)
    out = AuxLossAutoScaler.apply(w * 2, w.square().sum(), 0.5)
    torch.testing.assert_close(out, w.detach() * 2)
    out.sum().backward()
    torch.testing.assert_close(w.grad, 2 + 0.5 * 2 * w.detach())


@pytest.mark.parametrize("in_backward", [False, True])
def test_aux_loss_in_backward_equals_adding_it_and_is_not_counted_twice(in_backward):
    moe = _moe(experts=4, top_k=2).train()
    moe.aux_loss_in_backward = in_backward
    moe.aux_loss_weights = {"importance_load": 1.0}
    x = torch.randn(3, 5, 6)

    def router_grad(add_aux: bool) -> torch.Tensor:
        moe.zero_grad()
        loss = moe(x).square().mean()
        (loss + aux_loss(moe) if add_aux else loss).backward()
        return moe.router.gate.weight.grad.clone()

    task_only = router_grad(False)
    with_aux = router_grad(True)
    if in_backward:  # the autoscaler already sent it; adding aux_loss(model) changes nothing
        torch.testing.assert_close(task_only, with_aux)
        moe.aux_loss_in_backward = False
        torch.testing.assert_close(router_grad(True), with_aux)  # the same as adding it by hand
        assert not torch.allclose(router_grad(False), with_aux)  # and it is not the task gradient alone
    else:
        assert not torch.allclose(task_only, with_aux)

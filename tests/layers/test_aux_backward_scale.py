"""The in-backward aux loss in the loops people use: timm's train.py step (loss / N over N accumulation steps,
timm's NativeScaler around a GradScaler at 65536) gives the router exactly the gradient of the loss the loop
minimizes plus the aux loss on the same footing; a mismatch warns."""

from __future__ import annotations

import warnings

import pytest
import torch
from timm.utils import NativeScaler

import moespec
from moespec.layers.moe import BACKWARD_SCALE_CHECK

from ..conftest import TINY_VIT, randomize

ROUTER = "blocks.1.mlp.router.gate.weight"
VIT_32 = {**TINY_VIT, "kwargs": {**TINY_VIT["kwargs"], "img_size": 32}}


def _model(in_backward: bool, scale: float = 1.0):
    spec = moespec.load_spec({"backbone": VIT_32, "moe": [{"where": {"every": 1}, "experts": 4, "top_k": 2,
                                                           "aux_loss": {"kind": "importance_load", "weight": 0.5}}],
                              "aux_loss_in_backward": in_backward, "aux_loss_backward_scale": scale})
    return randomize(moespec.create_model(spec, seed=0)).train()


BATCHES = [torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]


def _reference_grad() -> torch.Tensor:
    """The gradient of (1/N) sum_i (task_i + aux_i), the loss written out in a loop that adds the aux loss."""
    model = _model(in_backward=False)
    loss = sum(model(x).square().mean() + moespec.aux_loss(model) for x in BATCHES) / len(BATCHES)
    loss.backward()
    return model.get_parameter(ROUTER).grad.clone()


def _timm_step(model, scaler: NativeScaler | None) -> torch.Tensor:
    """One optimizer step as timm's train.py takes it with --grad-accum-steps 2; the gradient the optimizer sees."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = {}
    optimizer.register_step_pre_hook(lambda *_: seen.update(grad=model.get_parameter(ROUTER).grad.clone()))
    for i, x in enumerate(BATCHES):
        loss = model(x).square().mean() / len(BATCHES)  # train.py: loss /= accum_steps
        need_update = i == len(BATCHES) - 1
        if scaler is None:
            loss.backward()
            if need_update:
                optimizer.step()
        else:
            scaler(loss, optimizer, need_update=need_update)
    return seen["grad"]


def test_accumulation_over_two_steps_is_exact_with_the_scale_set_to_one_half():
    expected = _reference_grad()
    torch.testing.assert_close(_timm_step(_model(True, scale=0.5), None), expected, rtol=1e-5, atol=1e-8)


def test_a_grad_scaler_at_65536_is_followed_exactly():
    expected = _reference_grad()
    model = _model(True, scale=0.5)
    scaler = NativeScaler(device="cpu")
    assert scaler._scaler.get_scale() == 65536.0
    moespec.follow_grad_scaler(model, scaler)
    torch.testing.assert_close(_timm_step(model, scaler), expected, rtol=1e-5, atol=1e-8)


def test_without_following_the_scaler_the_aux_share_is_wrong_by_the_scale():
    """What the scale knobs fix: under the scaler, an unfollowed aux gradient is 1/65536 of its share."""
    expected, task_only = _reference_grad(), _model(False)
    for x in BATCHES:
        (task_only(x).square().mean() / len(BATCHES)).backward()
    aux_share = expected - task_only.get_parameter(ROUTER).grad
    got = _timm_step(_model(True, scale=0.5), NativeScaler(device="cpu"))
    torch.testing.assert_close(got, expected - aux_share * (1 - 1 / 65536), rtol=1e-4, atol=1e-8)


@pytest.fixture
def fresh_check():
    saved = BACKWARD_SCALE_CHECK.warned, BACKWARD_SCALE_CHECK.mismatches
    BACKWARD_SCALE_CHECK.warned, BACKWARD_SCALE_CHECK.mismatches = set(), 0
    yield
    BACKWARD_SCALE_CHECK.warned, BACKWARD_SCALE_CHECK.mismatches = saved


def test_accumulation_that_disagrees_with_the_scale_warns_on_the_second_step(fresh_check):
    model = _model(True, scale=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _timm_step(model, None)
        assert not [w for w in caught if "backward passes per optimizer step" in str(w.message)]
        _timm_step(model, None)
    messages = [str(w.message) for w in caught if "backward passes per optimizer step" in str(w.message)]
    assert len(messages) == 1 and "set it to 1/2" in messages[0] and "aux_loss_backward_scale=0.5" in messages[0]


def test_a_matching_scale_does_not_warn(fresh_check):
    model = _model(True, scale=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _timm_step(model, None)
    assert not [w for w in caught if "moespec" in str(w.message)]


def test_float16_autocast_without_a_followed_scaler_warns(fresh_check):
    model = _model(True)
    with warnings.catch_warnings(record=True) as caught, torch.autocast("cpu", dtype=torch.float16):
        warnings.simplefilter("always")
        model(BATCHES[0])
    assert any("under float16 autocast" in str(w.message) and "follow_grad_scaler" in str(w.message) for w in caught)


def test_register_timm_sets_the_scale(tmp_path):
    import timm

    spec = moespec.load_spec({"backbone": TINY_VIT, "moe": [{"where": {"every": 1}, "experts": 4, "top_k": 2}]})
    name = moespec.register_timm(spec, name="moespec_test_accum_vit", aux_loss_backward_scale=0.25)
    model = timm.create_model(name)
    assert {layer.aux_loss_backward_scale for layer in moespec.moe_layers(model).values()} == {0.25}
    with pytest.raises(moespec.MoespecError, match="aux_loss_backward_scale must be > 0"):
        moespec.register_timm(spec, name="moespec_test_accum_vit", aux_loss_backward_scale=0)

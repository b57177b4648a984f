"""Specs registered as timm models: timm's kwargs reach the backbone, and the aux loss reaches the routers
in a plain training loop that never calls `moespec.aux_loss`."""

from __future__ import annotations

import warnings

import pytest
import timm
import torch
import torch.nn.functional as F

import moespec
import moespec.apps.timm_registry

from ..conftest import TINY_VIT, make_spec, randomize

MOE = [{"where": {"every": 1}, "experts": 4, "top_k": 2, "aux_loss": {"kind": "importance_load", "weight": 1.0}}]


def test_timm_create_model_builds_the_spec_with_timm_kwargs():
    name = moespec.register_timm(make_spec(TINY_VIT, MOE), name="moespec_test_tiny_vit")
    assert name == "moespec_test_tiny_vit" and timm.is_model(name) and name in timm.list_models("moespec_test_*")
    model = timm.create_model(name, pretrained=False, num_classes=3, drop_path_rate=0.2)
    assert model.training  # like any fresh timm model
    assert model.num_classes == 3 and model(torch.randn(2, 3, 64, 64)).shape == (2, 3)
    # timm's kwargs reach the backbone
    assert model.get_submodule("blocks.1.drop_path1").drop_prob == pytest.approx(0.2)
    assert list(moespec.moe_layers(model)) == ["blocks.0.mlp", "blocks.1.mlp"]
    spec = model.moespec_spec
    assert spec.backbone.kwargs == {**TINY_VIT["kwargs"], "num_classes": 3, "drop_path_rate": 0.2}
    assert spec.aux_loss_in_backward and all(m.aux_loss_in_backward for m in moespec.moe_layers(model).values())
    # the name's pretrained_cfg: the backbone's at the spec's input size (tests/apps/test_timm_registry_names.py)
    assert timm.data.resolve_data_config({}, model=model)["input_size"] == (3, 64, 64)


def test_a_spec_file_registers_under_its_name(tmp_path):
    path = tmp_path / "tiny-vit-moe.yaml"
    path.write_text("backbone: {model: vit_small_patch16_224, kwargs: {depth: 2, img_size: 64}}\n"
                    "moe: [{where: {last: 1}, experts: 2}]\n")
    name = moespec.register_timm(path, aux_loss_in_backward=False)
    assert name == "tiny_vit_moe"
    model = timm.create_model(name, num_classes=5)
    assert model.num_classes == 5 and not model.moespec_spec.aux_loss_in_backward
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert moespec.register_timm(path) == name  # registering again replaces the entry, without a warning
    assert timm.create_model(name).moespec_spec.aux_loss_in_backward


@pytest.mark.parametrize("name,message", [
    ("vit_small_patch16_224", "is already a timm model"),
    ("vit.moe", "cannot be a timm model name"),
    ("", "cannot be a timm model name"),
])
def test_bad_names_are_refused(name, message):
    with pytest.raises(moespec.MoespecError, match=message):
        moespec.register_timm(make_spec(TINY_VIT, MOE), name=name)


def test_pretrained_goes_through_upcycling(monkeypatch):
    """timm's `pretrained=True` upcycles from the spec's dense source (timm's weights need a network, so
    the upcycler is replaced here by a recorder)."""
    seen = []

    def fake_upcycle(spec):
        seen.append(spec)
        return moespec.create_model(spec)

    monkeypatch.setattr(moespec.apps.timm_registry, "upcycle", fake_upcycle)
    name = moespec.register_timm(make_spec(TINY_VIT, MOE), name="moespec_test_pretrained")
    timm.create_model(name, pretrained=True, num_classes=7)
    assert len(seen) == 1 and seen[0].backbone.pretrained and seen[0].backbone.kwargs["num_classes"] == 7


def _train(name: str, state: dict, add_aux: bool, steps: int = 2) -> dict[str, torch.Tensor]:
    """A plain loop, as timm's train script writes it; returns the router weights after `steps` SGD steps."""
    model = timm.create_model(name, num_classes=3)
    model.load_state_dict(state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        images, labels = torch.randn(2, 3, 64, 64, generator=generator), torch.randint(0, 3, (2,), generator=generator)
        loss = F.cross_entropy(model(images), labels)
        if add_aux:
            loss = loss + moespec.aux_loss(model)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items() if ".router." in k}


def test_the_aux_loss_reaches_the_routers_in_a_loop_that_never_adds_it():
    spec = make_spec(TINY_VIT, MOE)
    scaled = moespec.register_timm(spec, name="moespec_test_aux_in_backward")
    plain = moespec.register_timm(spec, name="moespec_test_aux_by_hand", aux_loss_in_backward=False)
    state = randomize(timm.create_model(plain, num_classes=3)).state_dict()  # a head that passes gradients

    autoscaled = _train(scaled, state, add_aux=False)
    by_hand = _train(plain, state, add_aux=True)
    without = _train(plain, state, add_aux=False)
    assert autoscaled.keys() == by_hand.keys() == {"blocks.0.mlp.router.gate.weight", "blocks.1.mlp.router.gate.weight"}
    for key in autoscaled:
        torch.testing.assert_close(autoscaled[key], by_hand[key], atol=1e-6, rtol=1e-5)
        assert (autoscaled[key] - without[key]).abs().max() > 1e-4  # the aux loss moved the routers
    # (that adding moespec.aux_loss as well does not count it twice: tests/layers/test_moe_layer.py)

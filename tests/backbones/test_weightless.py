"""A backbone without weight storage counts what the real one counts, and keeps its buffers and tied weights."""

from __future__ import annotations

import pytest
import torch
from timm.models import register_model
from torch import nn

import moespec
from moespec.backbones import create_backbone, create_weightless_backbone
from moespec.counting import count_macs, count_params

from ..conftest import TINY_CONVNEXT, TINY_INPUT, TINY_VIT, make_spec


class _TiedNet(nn.Module):
    """Two projections sharing one weight, a buffer whose values the forward reads (as Swin's relative position
    index), and, with `mask_on_weight_device`, a buffer made on a parameter's device while building (as Swin's
    attention mask)."""

    def __init__(self, num_classes: int = 16, mask_on_weight_device: bool = False, **kwargs):
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, num_classes)
        self.second.weight = self.first.weight
        self.register_buffer("order", torch.arange(16).flip(0))
        self.register_buffer("mask", torch.ones(16, device=self.first.weight.device if mask_on_weight_device else None))

    def forward(self, x):
        return self.second(self.first(x.flatten(1)[:, self.order]) * self.mask)


@register_model
def moespec_test_tied_net(pretrained: bool = False, **kwargs) -> nn.Module:
    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("pretrained_cfg") and k != "cache_dir"}
    return _TiedNet(**kwargs)


def _no_storage(model: nn.Module) -> bool:
    """Every parameter is backed by one element of memory."""
    return all(p.untyped_storage().nbytes() == p.element_size() for p in model.parameters())


@pytest.mark.parametrize("backbone", [TINY_VIT, TINY_CONVNEXT], ids=["vit", "convnext"])
def test_counts_what_the_real_backbone_counts_without_its_weights(backbone):
    spec = make_spec(backbone, [])
    real, light = create_backbone(spec), create_weightless_backbone(spec)
    assert [(n, p.shape, p.dtype) for n, p in light.named_parameters()] == [
        (n, p.shape, p.dtype) for n, p in real.named_parameters()]
    assert _no_storage(light) and not _no_storage(real)
    assert count_params(light) == count_params(real)
    assert count_macs(light, tuple(TINY_INPUT)) == count_macs(real, tuple(TINY_INPUT))


@pytest.mark.parametrize("mask_on_weight_device", [False, True], ids=["built-on-meta", "built-for-real"])
def test_buffers_are_real_and_tied_weights_stay_tied(mask_on_weight_device):
    spec = make_spec({"model": "moespec_test_tied_net", "kwargs": {"mask_on_weight_device": mask_on_weight_device}},
                     [], input_size=[1, 4, 4])
    real, light = create_backbone(spec), create_weightless_backbone(spec)
    assert light.second.weight is light.first.weight
    assert count_params(light) == count_params(real) == 16 * 16 + 2 * 16
    assert _no_storage(light)
    buffers = zip(real.buffers(), light.buffers(), strict=True)
    assert all(torch.equal(a, b) and b.device.type == "cpu" for a, b in buffers)
    assert count_macs(light, (1, 4, 4)) == count_macs(real, (1, 4, 4))


TINY_SWINV2 = {"model": "swinv2_tiny_window8_256",
               "kwargs": {"depths": (1, 1, 2, 1), "embed_dim": 24, "num_heads": (1, 2, 2, 4), "img_size": 64,
                          "window_size": 4, "num_classes": 10}}


def test_swinv2_with_kwargs_counts():
    """SwinV2 copies a tensor made on a parameter's device into a buffer while it is built, so it cannot be built
    with its parameters on the meta device. With kwargs in the spec, that failure was a spec error ("Cannot copy
    out of meta tensor; no data!") and `moespec stats` refused every SwinV2 spec with kwargs; it is built for
    real instead, like SwinV2 without kwargs."""
    spec = make_spec(TINY_SWINV2, [{"where": {"stage_last": 2}, "experts": 2}])
    real, light = create_backbone(spec), create_weightless_backbone(spec)
    assert count_params(light) == count_params(real) and _no_storage(light)
    assert moespec.stats(spec).dense_params == count_params(real)

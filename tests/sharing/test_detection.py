"""docs/detection.md's recipe, run as written: a moespec ConvNeXt and a ViT (`dynamic_img_size`) as Faster R-CNN
backbones take one training step on random images of two sizes, with the aux loss in torchvision's loss dict."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import moespec

PAGE = Path(__file__).resolve().parent.parent.parent / "docs" / "detection.md"


@pytest.fixture(scope="module")
def recipe() -> dict:
    """The namespace the page's Python block leaves, and each detector's parameters before its step."""
    (code,) = re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(encoding="utf-8"), re.S | re.M)
    before: dict = {}
    step = torch.optim.AdamW.step

    def recorded_step(optimizer, *args, **kwargs):  # the parameters as they were before the optimizer moved them
        for group in optimizer.param_groups:
            for p in group["params"]:
                before.setdefault(id(p), p.detach().clone())
        return step(optimizer, *args, **kwargs)

    namespace: dict = {"__name__": "detection_recipe"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.optim.AdamW, "step", recorded_step)
        exec(compile(code, str(PAGE), "exec"), namespace)
    namespace["before"] = before
    return namespace


@pytest.mark.slow  # two detectors' forward, backward and step: about 10 s
@pytest.mark.parametrize("name", ["det-convnext", "det-vit"])
def test_one_training_step_with_the_aux_loss_in_the_loss_dict(recipe, name):
    losses, model = recipe["losses_of"][name], recipe["detectors"][name]
    assert set(losses) == {"loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg", "loss_moe_aux"}
    assert all(math.isfinite(value) for value in losses.values()) and losses["loss_moe_aux"] > 0
    layers = moespec.moe_layers(model)
    assert len(layers) == 2 and all(layer.aux_loss_in_backward is False for layer in layers.values())
    routers = [(n, p) for n, p in model.named_parameters() if ".router." in n]
    assert routers and all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in routers)
    moved = [n for n, p in routers if not torch.equal(p.detach(), recipe["before"][id(p)])]
    assert moved == [n for n, _ in routers]  # the step trained the routers


@pytest.mark.slow
def test_the_vit_routes_the_grid_of_the_padded_batch_not_its_own(recipe):
    """Built at 64 px (16 patches), the ViT ran on torchvision's 96 x 96 batch: 36 patches and [CLS] per image,
    each image its own routing group."""
    layers = moespec.moe_layers(recipe["detectors"]["det-vit"]).values()
    assert [(layer.last_images, layer.last_items) for layer in layers] == [(2, 2 * 37)] * 2

"""A build on the meta device skips the initializers' value writes and nothing else."""

from __future__ import annotations

import pytest
import timm
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moespec.backbones import create_backbone
from moespec.backbones.meta import SkipMetaWrites

from ..conftest import TINY_CONVNEXT, TINY_INPUT, TINY_VIT, make_spec


def _layout(model: torch.nn.Module) -> dict:
    """What a meta tensor has: shape, dtype, stride, device and requires_grad of every parameter and buffer."""
    return {name: (t.shape, t.dtype, t.stride(), t.device, t.requires_grad)
            for name, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize("backbone", [TINY_VIT, TINY_CONVNEXT], ids=["vit", "convnext"])
def test_a_meta_build_has_the_layout_of_one_that_runs_the_initializers(backbone):
    with torch.device("meta"):
        initialized = timm.create_model(backbone["model"], **backbone["kwargs"])
    skipped = create_backbone(make_spec(backbone, []), device="meta")
    assert _layout(skipped) == _layout(initialized)
    assert skipped(torch.empty(2, *TINY_INPUT, device="meta")).shape == (2, 10)  # and runs on meta


class _AtenLog(TorchDispatchMode):
    """The aten ops that reach the dispatcher."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_only_value_writes_to_meta_tensors_are_skipped():
    real, meta = torch.zeros(3), torch.zeros(3, device="meta")
    with _AtenLog() as log, SkipMetaWrites():
        assert meta.add_(1) is meta
        torch.nn.init.trunc_normal_(meta)
        assert log.ops == []  # no value write to the meta tensor reached the dispatcher
        assert real.add_(1) is real
        meta.unsqueeze_(0).requires_grad_()  # metadata changes in place: run as usual
    assert real.tolist() == [1.0, 1.0, 1.0]  # a real tensor is still written
    assert meta.shape == (1, 3) and meta.requires_grad


def test_a_real_build_inside_is_the_same_as_outside():
    torch.manual_seed(0)
    outside = timm.create_model(TINY_VIT["model"], **TINY_VIT["kwargs"])
    torch.manual_seed(0)
    with SkipMetaWrites():
        inside = timm.create_model(TINY_VIT["model"], **TINY_VIT["kwargs"])
    for (name, a), b in zip(outside.state_dict().items(), inside.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

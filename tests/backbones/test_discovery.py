"""Finding residual blocks and stages from the module tree (moespec.backbones.discovery), on real timm models."""

from __future__ import annotations

import pytest
import timm
from timm.layers import Mlp
from timm.models.mlp_mixer import MlpMixer
from torch import nn

from moespec.backbones import find_blocks
from moespec.errors import SpecError
from moespec.spec import Block


def test_a_vit_is_one_stage_of_blocks_with_an_mlp():
    layout = find_blocks(timm.create_model("vit_small_patch16_224", depth=3, img_size=64))
    assert layout.blocks == tuple(Block(i, f"blocks.{i}", 0, ("mlp",)) for i in range(3))
    assert layout.stages == ((0, 1, 2),)
    assert layout.describe() == "3 blocks (blocks.0 .. blocks.2) in 1 stage(s) of sizes [3]"


def test_convnext_stages_follow_its_depths():
    layout = find_blocks(timm.create_model("convnext_tiny", depths=(1, 2, 3, 1)))
    assert layout.stages == ((0,), (1, 2), (3, 4, 5), (6,))
    assert [b.path for b in layout.blocks] == ["stages.0.blocks.0", "stages.1.blocks.0", "stages.1.blocks.1",
                                               "stages.2.blocks.0", "stages.2.blocks.1", "stages.2.blocks.2",
                                               "stages.3.blocks.0"]
    assert [b.stage for b in layout.blocks] == [0, 1, 1, 2, 2, 2, 3]


def test_a_mixer_block_has_two_ffn_sublayers():
    layout = find_blocks(MlpMixer(num_blocks=2, img_size=64, embed_dim=32))  # the class: the entry point fixes depth
    assert [b.sublayers for b in layout.blocks] == [("mlp_tokens", "mlp_channels")] * 2


def _refusal(model: nn.Module) -> str:
    with pytest.raises(SpecError) as error:
        find_blocks(model)
    (problem,) = error.value.problems
    assert problem.path == "backbone.model"
    return problem.message


def test_a_model_without_an_ffn_is_refused_for_that():
    message = _refusal(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)))
    assert message.startswith("this model has no FFN sublayer; MoE surgery needs one (supported FFN families: Mlp, "
                              "GlobalResponseNormMlp, ConvMlp, GluMlp, SwiGLU and ")
    assert message.endswith(" more (moespec/backbones/families.py))") and len(message) < 200


class NewFFN(nn.Module):
    """An FFN class no adapter knows."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


class Residual(nn.Module):
    def __init__(self, ffn: nn.Module):
        super().__init__()
        self.ffn = ffn

    def forward(self, x):
        return x + self.ffn(x)


def test_an_ffn_class_without_an_adapter_is_named_with_where_it_is():
    message = _refusal(nn.Sequential(Residual(NewFFN()), Residual(NewFFN())))
    assert message.startswith("this model's FFN class NewFFN has no moespec adapter yet (0.ffn (NewFFN), 1.ffn "
                              "(NewFFN)); supported FFN families: Mlp")


def test_a_known_ffn_outside_any_block_is_named():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = Mlp(4, 8)

        def forward(self, x):
            return x + self.mlp(x)

    assert _refusal(Net()) == ("found FFNs, but none inside a block of an nn.Sequential / nn.ModuleList, which is "
                               "how moespec finds residual blocks: mlp (Mlp)")

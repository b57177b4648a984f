"""Finding residual blocks and stages from the module tree (moespec.backbones.discovery), on real timm models."""

from __future__ import annotations

import pytest
import timm
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


def test_a_model_without_a_known_ffn_is_a_clear_error():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(SpecError) as error:
        find_blocks(model)
    (problem,) = error.value.problems
    assert problem.path == "backbone.model"
    assert problem.message.startswith("found no residual blocks with a known FFN in this model; supported FFN "
                                      "families: Mlp, GlobalResponseNormMlp, ConvMlp, GluMlp, SwiGLU")

"""The FFN classes of timm's model files (moespec.backbones.families, composed.py): each is found, rebuilt as an
expert bank, and cut into an expert whose output, after the FFN's own input module (`pre`), is the dense FFN's
in eval mode (BatchNorms folded with their running statistics); those no expert can run are refused with the
reason."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from timm.layers import GatedMlp
from torch import nn

import moespec
from moespec.backbones import find_adapter, find_blocks
from moespec.errors import SpecError

from ..conftest import randomize

C, H = 8, 16  # in / out width and hidden width of every FFN here


def timm_file(name: str):
    """timm.models.<name>, or a skip where this timm has no such model file (Gemma 4 came in timm 1.0.30)."""
    return pytest.importorskip(f"timm.models.{name}")


def _conv_norm_sequential():  # iFormer's FFN body: ConvNorm -> GELU -> ConvNorm
    return nn.Sequential(timm_file("repvit").ConvNorm(C, H, 1), nn.GELU(), timm_file("repvit").ConvNorm(H, C, 1))


def _clipped_gemma() -> nn.Module:
    """Gemma 4's gated MLP with clippable linears, each with its own finite bounds, tight enough to bite."""
    ffn = timm_file("gemma4_vit").Gemma4GatedMlp(C, H, use_clipped_linears=True)
    bounds = {"gate_proj": (-0.5, 0.6, -0.4, 0.3), "up_proj": (-0.7, 0.5, -0.2, 0.35),
              "down_proj": (-0.8, 0.9, -0.04, 0.05)}
    for projection, values in bounds.items():
        for name, value in zip(("input_min", "input_max", "output_min", "output_max"), values, strict=True):
            getattr(ffn, projection).get_buffer(name).fill_(value)
    return ffn


FAMILIES = {  # name -> (a small dense FFN, its input is channels-first)
    "NormMlp": (lambda: timm_file("tiny_vit").NormMlp(C, H), False),
    "SwiftFormerMlp": (lambda: timm_file("swiftformer").Mlp(C, H), True),
    "FastVitConvMlp": (lambda: timm_file("fastvit").ConvMlp(C, H), True),
    "InceptionNextConvMlp": (lambda: timm_file("inception_next").ConvMlp(C, H, norm_layer=nn.BatchNorm2d), True),
    "EfficientFormerConvMlp": (lambda: timm_file("efficientformer").ConvMlpWithNorm(C, H), True),
    "EfficientFormerV2ConvMlp": (lambda: timm_file("efficientformer_v2").ConvMlpWithNorm(C, H), True),
    "LevitMlp": (lambda: timm_file("levit").LevitMlp(C, H), False),
    "LevitMlp(conv)": (lambda: timm_file("levit").LevitMlp(C, H, use_conv=True), True),
    "RepVitMlp": (lambda: timm_file("repvit").RepVitMlp(C, H, nn.GELU), True),
    "EfficientVitMsraConvMlp": (lambda: timm_file("efficientvit_msra").ConvMlp(C, H), True),
    "ShvitFFN": (lambda: timm_file("shvit").FFN(C, H), True),
    "EfficientVimFFN": (lambda: timm_file("efficientvim").FFN(C, H), True),
    "SpatialMlp": (lambda: timm_file("visformer").SpatialMlp(C, H), True),
    "GatedMlp": (lambda: GatedMlp(C, H), False),
    "GeGluMlp": (lambda: timm_file("vitamin").GeGluMlp(C, H), False),
    "Gemma4GatedMlp": (lambda: timm_file("gemma4_vit").Gemma4GatedMlp(C, H), False),
    "Gemma4GatedMlp(clipped)": (lambda: _clipped_gemma(), False),
    "Sequential(conv, bn, act, conv)": (lambda: nn.Sequential(nn.Conv2d(C, H, 1, bias=False), nn.BatchNorm2d(H),
                                                              nn.ReLU(), nn.Conv2d(H, C, 1, bias=False)), True),
    "Sequential(ConvNorm, act, ConvNorm)": (_conv_norm_sequential, True),
    "Sequential(linear, act, dropout, linear)": (lambda: nn.Sequential(nn.Linear(C, H), nn.GELU(), nn.Dropout(0.1),
                                                                       nn.Linear(H, C)), False),
}


def _random_statistics(module: nn.Module, seed: int = 1) -> nn.Module:
    """BatchNorm running statistics away from (0, 1), so that folding them is checked."""
    generator = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(0.5 * torch.randn(m.running_mean.shape, generator=generator))
            m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=generator))
    return module


@pytest.mark.parametrize("name", list(FAMILIES))
def test_an_expert_cut_from_every_unit_after_the_shared_pre_module_is_the_dense_ffn(name):
    make, channels_first = FAMILIES[name]
    dense = _random_statistics(randomize(make())).eval()
    adapter = find_adapter(dense)
    assert adapter is not None and adapter.refusal(dense) is None
    shape = adapter.shape(dense)
    assert (shape.in_features, shape.hidden, shape.out_features) == (C, H, C)
    assert shape.channels_dim == (1 if channels_first else -1)
    bank = adapter.build_experts(dense, 1, H)
    state = adapter.expert_state(dense.state_dict(), torch.arange(H))
    with torch.no_grad():
        for param_name, param in bank.named_parameters():
            param[0].copy_(state[param_name].reshape(param.shape[1:]))
        for buffer_name, tensor in adapter.bank_buffers(dense.state_dict()).items():
            bank.get_buffer(buffer_name).copy_(tensor)
    pre = adapter.pre_module(dense)
    if pre is not None:
        pre.load_state_dict(adapter.pre_state(dense.state_dict()))
        pre.eval()
    x = torch.randn(2, C, 3, 5) if channels_first else torch.randn(2, 15, C)
    with torch.no_grad():
        expected = dense(x)
        inner = x if pre is None else pre(x)
        rows = (inner.movedim(1, -1) if channels_first else inner).reshape(-1, C)
        got = bank.eval()(rows, torch.tensor([rows.shape[0]]))
        got = got.reshape(2, 3, 5, C).movedim(-1, 1) if channels_first else got.reshape(2, 15, C)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_clamp_bounds_bite_and_an_unclipped_bank_has_none():
    dense = randomize(_clipped_gemma()).eval()
    with torch.no_grad():
        y = dense(3 * torch.randn(256, C, generator=torch.Generator().manual_seed(0)))  # seeded: the bound is met
    assert (y == -0.04).any() and y.max() <= 0.05  # down_proj clamps its output
    adapter = find_adapter(dense)
    assert adapter.build_experts(dense, 2, H).clamp.shape == (3, 4)
    plain = timm_file("gemma4_vit").Gemma4GatedMlp(C, H)
    assert adapter.build_experts(plain, 2, H).clamp is None and adapter.bank_buffers(plain.state_dict()) == {}


def test_the_bias_a_folded_batchnorm_gives_is_the_experts_even_where_the_conv_has_none():
    dense = _random_statistics(randomize(timm_file("repvit").RepVitMlp(C, H, nn.GELU))).eval()
    assert dense.conv1.c.bias is None
    bank = find_adapter(dense).build_experts(dense, 2, H)
    assert bank.fc1.bias is not None and bank.fc2.bias is not None


REFUSED = {  # a dense FFN no expert can run -> words of the reason
    "visformer spatial": (lambda: timm_file("visformer").SpatialMlp(C, H, spatial_conv=True),
                          "grouped 3x3 conv `conv2`"),
    "3x3 sequential": (lambda: nn.Sequential(nn.Conv2d(C, H, 1), nn.GELU(), nn.Conv2d(H, C, 3, padding=1)),
                       "is a 3x3 conv"),
}
MIXES_POSITIONS = {  # a dense FFN that mixes positions: whole copies under image routing -> words of the reason
    "pvt_v2": (lambda: timm_file("pvt_v2").MlpWithDepthwiseConv(C, H), "depthwise conv `dwconv`"),
    "gMLP": (lambda: GatedMlp(C, H, gate_layer=partial(timm_file("mlp_mixer").SpatialGatingUnit, seq_len=4)),
             "SpatialGatingUnit) mixes the tokens"),
    "efficientformer_v2 mid": (lambda: timm_file("efficientformer_v2").ConvMlpWithNorm(C, H, mid_conv=True), "`mid`"),
}


@pytest.mark.parametrize("name", list(MIXES_POSITIONS))
def test_an_ffn_that_mixes_positions_is_found_and_says_why(name):
    """Discovery finds its block (image routing takes it, `tests/layers/test_image_ffn.py`); the plan refuses it
    under token routing with this reason."""
    make, words = MIXES_POSITIONS[name]
    dense = make()
    adapter = find_adapter(dense)
    assert adapter.refusal(dense) is None and words in adapter.mixes_positions(dense)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Module()])
            self.blocks[0].mlp = dense

    assert find_blocks(Net()).blocks[0].sublayers == ("mlp",)


@pytest.mark.parametrize("name", list(REFUSED))
def test_an_ffn_no_expert_can_run_is_refused_with_the_reason(name):
    make, words = REFUSED[name]
    dense = make()
    reason = find_adapter(dense).refusal(dense)
    assert reason is not None and words in reason

    class Net(nn.Module):  # one block holding the FFN: discovery names the FFN and the reason
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Module()])
            self.blocks[0].mlp = dense

    with pytest.raises(SpecError, match="cannot be split into experts: blocks.0.mlp") as err:
        find_blocks(Net())
    assert words in str(err.value)


def test_a_sequential_that_is_not_an_ffn_is_no_ffn():
    for sequential in (nn.Sequential(nn.Conv2d(C, H, 1), nn.BatchNorm2d(H)),  # no activation
                       nn.Sequential(nn.Linear(C, H), nn.GELU(), nn.Linear(H, H), nn.GELU(), nn.Linear(H, C)),
                       nn.Sequential(nn.Linear(C, H), nn.LayerNorm(H), nn.Linear(H, C))):
        assert find_adapter(sequential) is None


def test_a_model_without_any_ffn_is_refused_for_having_none():
    with pytest.raises(SpecError, match="this model has no FFN sublayer; MoE surgery needs one"):
        moespec.plan(moespec.load_spec({"backbone": {"model": "resnet18", "kwargs": {"num_classes": 10}},
                                        "input_size": [3, 32, 32], "moe": [{"where": {"last": 1}, "experts": 2}]}))

"""FFN adapters (moespec.backbones.adapters): each timm FFN family is read, rebuilt as an expert bank, and cut
into experts whose output is the dense FFN's."""

from __future__ import annotations

import pytest
import torch
from timm.layers import ConvMlp, GlobalResponseNormMlp, GluMlp, Mlp, SwiGLU
from torch import nn

from moespec.backbones import find_adapter
from moespec.errors import MoespecError
from moespec.layers import Experts

from ..conftest import randomize

IN, HIDDEN, OUT = 12, 20, 12


def _families() -> dict[str, tuple[nn.Module, int]]:
    """name -> (a small dense FFN, its channels_dim)."""
    return {
        "Mlp": (Mlp(IN, HIDDEN, OUT), -1),
        "Mlp+norm": (Mlp(IN, HIDDEN, OUT, norm_layer=nn.LayerNorm), -1),
        "GluMlp": (GluMlp(IN, 2 * HIDDEN, OUT, act_layer=nn.SiLU), -1),  # fc1 makes 2H; fc2 reads H
        "SwiGLU": (SwiGLU(IN, HIDDEN, OUT), -1),
        "ConvMlp": (ConvMlp(IN, HIDDEN, OUT, norm_layer=nn.LayerNorm), 1),  # wrong norm shape: checked below
        "GlobalResponseNormMlp": (GlobalResponseNormMlp(IN, HIDDEN, OUT, use_conv=False), -1),
    }


def _one_expert_like(dense: nn.Module, units: torch.Tensor) -> Experts:
    adapter = find_adapter(dense)
    bank = adapter.build_experts(dense, 1, len(units))
    state = adapter.expert_state(dense.state_dict(), units)
    with torch.no_grad():
        for name, param in bank.named_parameters():
            param[0].copy_(state[name].reshape(param.shape[1:]))
    return bank.eval()


@pytest.mark.parametrize("name", ["Mlp", "Mlp+norm", "GluMlp", "SwiGLU", "GlobalResponseNormMlp"])
def test_one_expert_cut_from_every_unit_is_the_dense_ffn(name):
    dense, _ = _families()[name]
    dense = randomize(dense).eval()
    shape = find_adapter(dense).shape(dense)
    assert (shape.in_features, shape.hidden, shape.out_features, shape.channels_dim) == (IN, HIDDEN, OUT, -1)
    bank = _one_expert_like(dense, torch.arange(HIDDEN))
    x = torch.randn(2, 3, 4, IN)  # a channels-last feature map: GRN normalizes over each image's positions
    with torch.no_grad():
        expected = dense(x).reshape(-1, OUT)
        got = bank(x.reshape(-1, IN), torch.tensor([24]), torch.arange(2).repeat_interleave(12))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_conv_mlp_is_read_channels_first():
    dense = ConvMlp(IN, HIDDEN, OUT)
    shape = find_adapter(dense).shape(dense)
    assert (shape.family, shape.in_features, shape.hidden, shape.out_features, shape.channels_dim) == (
        "ConvMlp", IN, HIDDEN, OUT, 1)


def test_a_narrower_expert_takes_the_named_hidden_units():
    dense = randomize(SwiGLU(IN, HIDDEN, OUT))
    units = torch.tensor([3, 7, 11])
    state = find_adapter(dense).expert_state(dense.state_dict(), units)
    assert state["fc1.weight"].shape == (2 * len(units), IN)  # fc1_g rows then fc1_x rows, fused
    torch.testing.assert_close(state["fc1.weight"][:3], dense.fc1_g.weight[units])
    torch.testing.assert_close(state["fc1.weight"][3:], dense.fc1_x.weight[units])
    torch.testing.assert_close(state["fc2.weight"], dense.fc2.weight[:, units])
    torch.testing.assert_close(state["fc2.bias"], dense.fc2.bias)  # fc2's bias is whole


def test_subclasses_find_their_base_family_and_unknown_modules_none():
    class MyMlp(Mlp):
        pass

    assert find_adapter(MyMlp(IN, HIDDEN)) is find_adapter(Mlp(IN, HIDDEN))
    assert find_adapter(nn.Linear(IN, OUT)) is None


def test_an_unsupported_inner_norm_is_a_clear_error():
    dense = Mlp(IN, HIDDEN, OUT, norm_layer=nn.BatchNorm1d)
    with pytest.raises(MoespecError, match="inner norm of type BatchNorm1d, which moespec experts do not support"):
        find_adapter(dense).build_experts(dense, 2, HIDDEN)

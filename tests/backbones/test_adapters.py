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


def _with_dropout() -> dict[str, nn.Module]:
    """Each FFN class that has dropout, with its inner norm where it has one (timm: fc1, act, drop1, norm, fc2,
    drop2)."""
    return {
        "Mlp+norm": Mlp(IN, HIDDEN, OUT, norm_layer=nn.LayerNorm, drop=0.5),
        "GluMlp+norm": GluMlp(IN, 2 * HIDDEN, OUT, act_layer=nn.SiLU, norm_layer=nn.LayerNorm, drop=0.5),
        "SwiGLU+norm": SwiGLU(IN, HIDDEN, OUT, norm_layer=nn.LayerNorm, drop=0.5),
        "GlobalResponseNormMlp": GlobalResponseNormMlp(IN, HIDDEN, OUT, use_conv=False, drop=0.5),
    }


@pytest.mark.parametrize("name", list(_with_dropout()))
def test_in_training_one_expert_is_the_dense_ffn_with_its_dropout(name):
    """Issue 45 point 1: under the same seed, a one-expert bank in train mode draws the dense FFN's dropout masks
    at the same places (before the inner norm), so its output and gradients are the dense FFN's."""
    dense = randomize(_with_dropout()[name]).train()
    bank = _one_expert_like(dense, torch.arange(HIDDEN)).train()
    x = torch.randn(2, 3, 4, IN)
    upstream = torch.randn(2 * 3 * 4, OUT)
    results = []
    for module, run in ((dense, lambda t: dense(t).reshape(-1, OUT)),
                        (bank, lambda t: bank(t.reshape(-1, IN), torch.tensor([24]),
                                              torch.arange(2).repeat_interleave(12)))):
        xg = x.clone().requires_grad_()
        torch.manual_seed(7)
        y = run(xg)
        (y * upstream).sum().backward()
        fc2 = module.fc2.weight.grad.reshape(OUT, HIDDEN)
        results.append((y.detach(), xg.grad, fc2))
    (y_dense, gx_dense, fc2_dense), (y_bank, gx_bank, fc2_bank) = results
    assert (y_dense == 0).any()  # the dropout on the output dropped something: the masks are compared
    torch.testing.assert_close(y_bank, y_dense, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gx_bank, gx_dense, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(fc2_bank, fc2_dense, atol=1e-5, rtol=1e-4)

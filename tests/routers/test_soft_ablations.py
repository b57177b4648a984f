"""Soft MoE's routing ablations (Puigcerver et al. 2024, Table 2: Identity, Uniform, Soft-Uniform, Uniform-Soft):
each variant against the paper's definitions written out one image at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moespec
from moespec.layers import Experts, SoftMoE

from ..conftest import TINY_VIT, make_spec

VARIANTS = [("learned", "learned"), ("learned", "uniform"), ("uniform", "learned"), ("uniform", "uniform"),
            ("identity", "identity"), ("identity", "learned"), ("learned", "identity"), ("identity", "uniform")]
"""(dispatch, combine) as the layer names them; the spec's `soft` is the layer's `learned`."""


def _expert(bank: Experts, e: int, x: torch.Tensor) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, bank.fc1.weight[e], bank.fc1.bias[e])), bank.fc2.weight[e], bank.fc2.bias[e])


def _reference(layer: SoftMoE, x: torch.Tensor, dispatch: str, combine: str) -> torch.Tensor:
    """Y = C Y~, Y~ = the experts on their slots of X~ = D^T X, image by image, with D and C as the paper defines
    them: softmax over tokens / slots of l2norm(X) scale l2norm(Phi) (learned), 1 / N or 1 / S (uniform), I
    (identity)."""
    out = []
    for tokens in x:  # [N, C]
        count, slots = tokens.shape[0], layer.slots
        logits = None
        if layer.phi is not None:
            logits = F.normalize(tokens, dim=1) @ (layer.scale * F.normalize(layer.phi, dim=0))  # [N, S]
        d = _weights(dispatch, logits, count, slots, over=0)
        c = _weights(combine, logits, count, slots, over=1)
        slot_inputs = d.t() @ tokens  # [S, C]
        p = layer.slots_per_expert
        slot_outputs = torch.stack([_expert(layer.experts, s // p, slot_inputs[s]) for s in range(slots)])
        out.append(c @ slot_outputs)
    return torch.stack(out)


def _weights(kind: str, logits: torch.Tensor | None, count: int, slots: int, over: int) -> torch.Tensor:
    """[N, S] weights normalized over tokens (`over` 0, dispatch) or slots (1, combine)."""
    if kind == "learned":
        return logits.softmax(dim=over)
    if kind == "uniform":
        return torch.full((count, slots), 1.0 / (count, slots)[over])
    return torch.eye(count, slots)


@pytest.mark.parametrize(("dispatch", "combine"), VARIANTS)
def test_each_variant_computes_the_papers_definition(dispatch, combine):
    torch.manual_seed(0)
    experts, per_expert, tokens, dim = 3, 2, 6, 4  # 6 slots = 6 tokens: identity applies
    bank = Experts(experts, dim, 5, dim, act=nn.GELU())
    for p in bank.parameters():
        nn.init.normal_(p, std=0.5)
    layer = SoftMoE(bank, per_expert, dispatch=dispatch, combine=combine)
    x = torch.randn(2, tokens, dim)
    torch.testing.assert_close(layer(x), _reference(layer, x, dispatch, combine), atol=1e-5, rtol=1e-5)
    learned = "learned" in (dispatch, combine)
    assert (layer.phi is not None) == learned and len(layer.router_weights()) == int(learned)


def test_uniform_dispatch_feeds_every_slot_the_mean_token():
    layer = SoftMoE(Experts(2, 4, 5, 4, act=nn.GELU()), 2, dispatch="uniform", combine="uniform")
    x = torch.randn(1, 5, 4)
    dispatch, combine = layer.weights(x)
    slot_inputs = torch.einsum("bns,bnc->bsc", dispatch, x)
    torch.testing.assert_close(slot_inputs, x.mean(dim=1, keepdim=True).expand(1, 4, 4))
    y = layer(x)
    torch.testing.assert_close(y, y[:, :1].expand_as(y))  # every token gets the same output: the mean slot output


def test_identity_needs_one_slot_per_token():
    layer = SoftMoE(Experts(2, 4, 5, 4, act=nn.GELU()), 2, dispatch="identity", combine="identity")
    with pytest.raises(ValueError, match="needs one slot per token|as many slots as tokens"):
        layer(torch.randn(1, 5, 4))


def test_dispatch_identity_defaults_to_identity_combine_and_the_plan_says_so():
    spec = make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 17, "router": {"kind": "soft",
                                                                                  "dispatch": "identity"}}])
    router = spec.moe[0].router
    assert (router.dispatch, router.combine) == ("identity", "identity")
    assert moespec.load_spec("x.yaml", text=spec.to_yaml()).model_dump() == spec.model_dump()  # round trip
    assert "soft p=1 dispatch=identity combine=identity" in str(moespec.plan(spec))
    default = make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 4, "router": {"kind": "soft"}}])
    assert (default.moe[0].router.dispatch, default.moe[0].router.combine) == ("soft", "soft")
    layer = next(iter(moespec.moe_layers(moespec.create_model(default)).values()))
    assert (layer.dispatch, layer.combine) == ("learned", "learned")  # the spec's soft is the layer's learned


def test_stats_of_identity_with_too_few_slots_is_a_located_spec_error():
    """Tiny ViT at 64 px: 16 patches + [CLS] = 17 tokens per image; 4 experts x 1 slot is not 17."""
    spec = make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 4, "router": {"kind": "soft",
                                                                                 "dispatch": "identity"}}])
    with pytest.raises(moespec.SpecError) as info:
        moespec.stats(spec)
    (problem,) = info.value.problems
    assert problem.path == "moe.0.router.dispatch"
    assert "17 tokens per image, but experts x slots_per_expert = 4 x 1 = 4" in problem.message
    good = make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 17, "router": {"kind": "soft",
                                                                                  "dispatch": "identity"}}])
    counted = moespec.stats(good)
    plain = moespec.stats(make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 17, "router": {"kind": "soft"}}]))
    assert counted.total_params == plain.total_params - (384 * 17 + 1)  # no phi, no scale
    assert counted.gmacs < plain.gmacs  # no logits


@pytest.mark.parametrize("dispatch", ["identity", "uniform"])
def test_a_model_without_learned_routing_runs_forward_and_backward(dispatch):
    spec = make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 17, "router": {"kind": "soft", "dispatch": dispatch,
                                                                                  "combine": "uniform"}}])
    model = moespec.create_model(spec)
    layer = next(iter(moespec.moe_layers(model).values()))
    assert (layer.dispatch, layer.combine) == (dispatch, "uniform")
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_upcycling_identity_with_too_few_slots_is_a_spec_error_before_anything_is_written(tmp_path):
    """It wrote the checkpoint, then failed in the check's forward with an internal error."""
    bad = make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 4, "router": {"kind": "soft",
                                                                                "dispatch": "identity"}}])
    with pytest.raises(moespec.SpecError) as info:
        moespec.upcycle_to_checkpoint(bad, tmp_path / "out.safetensors")
    assert [problem.path for problem in info.value.problems] == ["moe.0.router.dispatch"]
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(moespec.SpecError, match="needs one slot per token"):
        moespec.upcycle(bad)
    good = make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 17, "router": {"kind": "soft",
                                                                                  "dispatch": "identity"}}])
    model = moespec.upcycle(good)
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 10)

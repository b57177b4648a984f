"""Parameters and MACs of MoE layers made from the composed FFN families (backbones/families.py), against hand
calculations on a tiny two-block net: a shared input norm (`pre`), a GLU's fused gate and up projections, and
BatchNorms folded into the experts' weights and biases."""

from __future__ import annotations

import pytest

import moespec

from ..conftest import FAMILY_HIDDEN, FAMILY_WIDTH, family_net

C, H, E, T = FAMILY_WIDTH, FAMILY_HIDDEN, 4, 16  # width, FFN hidden width, experts, positions (4 x 4 at 32 px)


# family -> (params of the dense FFN, of its shared `pre` module, of one expert; MACs of one expert per position:
#            fc1 + fc2, which fvcore also counts for the dense FFN (no biases); elements per position of the
#            BatchNorms folded into the experts, which fvcore counts in the dense FFN at 2 ops each in eval mode)
FAMILIES = {
    # LayerNorm (2C, kept as `pre`) -> fc1 (CH + H) -> fc2 (HC + C)
    "NormMlp": (2 * C + C * H + H + H * C + C, 2 * C, C * H + H + H * C + C, C * H + H * C, 0),
    # LayerNorm (2C, `pre`) -> w0, w1 (2 (CH + H)) -> w2 (HC + C); the expert's fc1 is [w0; w1]
    "GeGluMlp": (2 * C + 2 * (C * H + H) + H * C + C, 2 * C, 2 * (C * H + H) + H * C + C, 2 * C * H + H * C, 0),
    # conv (CH, no bias) + BN (2H) -> conv (HC) + BN (2C); folded: biases H and C, no BN
    "RepVitMlp": (C * H + 2 * H + H * C + 2 * C, 0, C * H + H + H * C + C, C * H + H * C, H + C),
    # Linear (CH, no bias) + BatchNorm1d (2H) -> Linear (HC) + BatchNorm1d (2C), as RepViT's
    "LevitMlp": (C * H + 2 * H + H * C + 2 * C, 0, C * H + H + H * C + C, C * H + H * C, H + C),
    # 7x7 depthwise conv (49C, no bias) + BN (2C), kept as `pre` -> 1x1 conv fc1 (CH + H) -> fc2 (HC + C)
    "FastVitConvMlp": (51 * C + C * H + H + H * C + C, 51 * C, C * H + H + H * C + C, C * H + H * C, 0),
    # Sequential: conv (CH) + BN (2H) -> ReLU -> conv (HC, no bias, no BN): the expert's fc2 has no bias
    "SequentialMlp": (C * H + 2 * H + H * C, 0, C * H + H + H * C, C * H + H * C, H),
    # act(gate_proj x) * up_proj x -> down_proj, no biases anywhere
    "Gemma4GatedMlp": (2 * C * H + H * C, 0, 2 * C * H + H * C, 2 * C * H + H * C, 0),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_params_and_macs_of_a_composed_family_match_the_hand_count(family):
    dense_ffn, pre, expert, expert_macs, folded = FAMILIES[family]
    spec = moespec.load_spec({"name": "family", "backbone": family_net(family),
                              "moe": [{"where": {"last": 1}, "experts": E, "router": {"kind": "topk", "top_k": 1}}]})
    s = moespec.stats(spec)
    router = C * E  # linear gate, no bias
    assert s.total_params == s.dense_params - dense_ffn + pre + router + E * expert
    assert s.activated_params == s.dense_params - dense_ffn + pre + router + expert
    layer_macs = T * C * E + T * (expert_macs + C)  # gate, the top-1 expert and its weighted combine per position
    assert round(s.layers[0].gmacs * 1e9) == layer_macs
    assert round((s.gmacs - s.dense_gmacs) * 1e9) == layer_macs - T * expert_macs - 2 * T * folded

"""torch's FlopCounterMode sees the experts of the GPU's sync-free step (issue 63, point 5): the grouped
matmuls are moespec custom ops, opaque to a counter without the flop formulas `layers/ops/grouped.py`
registers (thop and ptflops, which cost modules by type, see none of them)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from moespec.layers import Experts, LinearGate, MoE, TopKRouter, device_path


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_grouped_step_counts_the_gate_and_every_routed_row(top_k):
    tokens, dim, hidden, experts = 40, 16, 32, 4
    bank = Experts(experts, dim, hidden, dim, act=torch.nn.GELU())
    layer = MoE(TopKRouter(LinearGate(dim, experts), experts, top_k), bank).eval()
    x = torch.randn(tokens, dim)
    with torch.no_grad(), device_path(), FlopCounterMode(display=False) as counter:
        layer(x)
    # by hand: the gate T·C·E, then each of the T·k rows through fc1 (C·H) and fc2 (H·C); the combine is a
    # gather-sum, not a matmul, which FlopCounterMode does not count
    macs = tokens * dim * experts + tokens * top_k * (dim * hidden + hidden * dim)
    assert counter.get_total_flops() == 2 * macs


def test_the_weight_gradients_are_counted_too():
    tokens, dim, hidden, experts = 40, 16, 32, 4
    bank = Experts(experts, dim, hidden, dim, act=torch.nn.GELU())
    layer = MoE(TopKRouter(LinearGate(dim, experts), experts, 2), bank).train()
    x = torch.randn(tokens, dim, requires_grad=True)
    with device_path():
        y = layer(x)
        with FlopCounterMode(display=False) as counter:
            y.backward(torch.ones_like(y))
    rows = tokens * 2  # each expert matmul's backward: the input's gradient and the weight's, each rows·in·out
    experts_backward = 2 * rows * (dim * hidden + hidden * dim)
    biases = rows * (hidden + dim)  # fc1's and fc2's bias gradients: a grouped matmul of a row of ones by the rows
    gate_backward = 2 * tokens * dim * experts  # the gate's input and weight gradients
    assert counter.get_total_flops() == 2 * (experts_backward + biases + gate_backward)

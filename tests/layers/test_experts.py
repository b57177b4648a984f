"""The expert bank's three expert steps (loop, padded bmm, grouped_mm) compute the same function and the
same gradients, for every FFN structure the adapters build."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moespec.layers import Experts

STRUCTURES = {
    "plain": dict(),
    "no_bias": dict(bias=(False, False)),
    "swiglu": dict(glu="act_first", act=nn.SiLU()),
    "glu": dict(glu="act_last", act=nn.Sigmoid()),
    "layernorm": dict(inner_norm="layernorm"),
    "layernorm_before_act": dict(inner_norm="layernorm_before_act"),
}


def _bank(structure: str, experts: int = 4) -> Experts:
    torch.manual_seed(0)
    options = {"act": nn.GELU(), **STRUCTURES[structure]}
    bank = Experts(experts, 8, 4, 12, **options)  # fp32 grouped_mm needs widths that are multiples of 4
    for p in bank.parameters():
        nn.init.normal_(p, std=0.5)  # non-trivial norms and biases
    return bank


def _run(bank: Experts, dispatch: str, x: torch.Tensor, counts: torch.Tensor, grad: torch.Tensor):
    """Output, input gradient and every parameter gradient of one forward + backward."""
    bank.dispatch = dispatch
    bank.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = bank(x, counts)
    (y * grad).sum().backward()
    grads = {name: p.grad for name, p in bank.named_parameters()}
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("dispatch", ["padded", "grouped_mm"])
@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_batched_steps_match_the_loop(structure, dispatch):
    bank = _bank(structure)
    counts = torch.tensor([3, 0, 6, 2])  # an expert with no rows, uneven segments
    x, grad = torch.randn(11, 8), torch.randn(11, 12)
    y, x_grad, grads = _run(bank, dispatch, x, counts, grad)
    y_ref, x_grad_ref, grads_ref = _run(bank, "loop", x, counts, grad)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x_grad, x_grad_ref, atol=1e-5, rtol=1e-5)
    for name, g in grads_ref.items():  # an expert with no rows gets zero gradient, not garbage from padding
        torch.testing.assert_close(grads[name], g, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("dispatch", ["loop", "padded", "grouped_mm"])
def test_no_rows_gives_an_empty_output(dispatch):
    bank = _bank("plain")
    bank.dispatch = dispatch
    assert bank(torch.zeros(0, 8), torch.zeros(4, dtype=torch.long)).shape == (0, 12)


def test_auto_picks_padded_for_small_cpu_inputs_and_loop_for_large_or_grn():
    from moespec.layers.experts import PADDED_MAX_ROWS

    bank = _bank("plain")
    assert bank.strategy(torch.zeros(PADDED_MAX_ROWS, 8)) == "padded"
    assert bank.strategy(torch.zeros(PADDED_MAX_ROWS + 1, 8)) == "loop"
    grn = Experts(2, 6, 5, 6, act=nn.GELU(), inner_norm="grn")
    grn.dispatch = "padded"  # GRN normalizes per image: only the loop knows the images
    assert grn.strategy(torch.zeros(8, 6)) == "loop"


def test_batched_equals_each_expert_on_its_own_rows():
    bank = _bank("layernorm")
    x = torch.randn(4, 3, 8)
    per_expert = torch.stack([bank.forward(x[e], torch.eye(4, dtype=torch.long)[e] * 3) for e in range(4)])
    torch.testing.assert_close(bank.batched(x), per_expert, atol=1e-5, rtol=1e-5)

"""The expert steps and the transport use a bank only through its declared surface (`steps.bank.ExpertBank`): each
step runs a fake bank that implements that surface and nothing else (a plain object, not `Experts`), and computes
each expert's FFN on its own rows, forward and backward, as a per-expert loop by hand does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moespec.layers import Mode
from moespec.layers.steps import STEPS, choose
from moespec.layers.steps.rows import RoutedRows, Segments
from moespec.layers.steps.transport import LOCAL

EXPERTS, DIM, HIDDEN = 3, 8, 16
COUNTS = [4, 0, 5]  # an expert without rows


class FakeBank:
    """E GELU experts with biases, the surface of `ExpertBank` and nothing more."""

    step, needs_groups, glu, inner_norm, clamped = "auto", False, None, "none", False
    drop, training, weight_dtype = (0.0, 0.0), True, torch.float32
    transport = LOCAL

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.local_experts, self.hidden, self.out_features = EXPERTS, HIDDEN, DIM
        self.widths = (DIM, HIDDEN, HIDDEN, DIM)
        self.act = nn.GELU()
        shapes = (EXPERTS, HIDDEN, DIM), (EXPERTS, HIDDEN), (EXPERTS, DIM, HIDDEN), (EXPERTS, DIM)
        self.weights = [torch.randn(shape, generator=generator).mul_(0.3).requires_grad_() for shape in shapes]

    def params(self):
        w1, b1, w2, b2 = self.weights
        return [w1, b1, None, None, w2, b2]

    def parameters(self):
        return iter(self.weights)

    def ffn(self, x, params, groups, linear=None, activated=None):
        w1, b1, _, _, w2, b2 = params
        linear = F.linear if linear is None else linear
        h = activated(x, w1, b1) if activated is not None else F.gelu(linear(x, w1, b1))
        return linear(h, w2, b2)

    def stacked(self, x, mode):
        w1, b1, w2, b2 = self.weights
        h = F.gelu(torch.baddbmm(b1.unsqueeze(1), x, w1.transpose(1, 2)))
        return torch.baddbmm(b2.unsqueeze(1), h, w2.transpose(1, 2))

    def run_local(self, x, segments, groups, mode, step=None):
        step = step or choose(self, x.shape[0], x, segments.counts, mode)
        return STEPS[step].run(self, x, segments, groups, mode)

    def run_slots(self, x, mode):
        return self.stacked(x, mode)

    def step_combines(self, rows):
        return rows.position is not None


def _by_hand(bank: FakeBank, x: torch.Tensor) -> torch.Tensor:
    """Each expert's FFN on its own segment of rows, one F.linear at a time."""
    w1, b1, w2, b2 = bank.weights
    out, start = [], 0
    for e, count in enumerate(COUNTS):
        rows = x[start:start + count]
        out.append(F.linear(F.gelu(F.linear(rows, w1[e], b1[e])), w2[e], b2[e]))
        start += count
    return torch.cat(out)


def _gradients(y: torch.Tensor, x: torch.Tensor, bank: FakeBank) -> list[torch.Tensor]:
    return torch.autograd.grad(y.square().sum(), [x, *bank.weights])


@pytest.mark.parametrize("records", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("step", ["loop", "padded", "grouped_mm"])
def test_every_step_runs_a_bank_that_has_only_the_declared_surface(step, records):
    bank = FakeBank()
    x = torch.randn(sum(COUNTS), DIM, generator=torch.Generator().manual_seed(1), requires_grad=records)
    mode = Mode(records=records, sync_free=step == "grouped_mm")
    with torch.set_grad_enabled(records):
        y = LOCAL.run(bank, x, Segments(torch.tensor(COUNTS)), None, mode, step)
    want = _by_hand(bank, x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    if records:
        for got, expected in zip(_gradients(y, x, bank), _gradients(want, x, bank), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_the_chooser_and_the_grouped_combine_read_only_the_surface():
    """On the sync-free path the grouped step gathers and combines the pairs itself (`bias_act` for fc1's bias and
    GELU): the weighted sum of each item's two experts' outputs, by hand."""
    bank = FakeBank()
    tokens = 6
    choices = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 0], [0, 2], [2, 1]])
    gates = torch.rand(tokens, 2, generator=torch.Generator().manual_seed(2))
    items = torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(3), requires_grad=True)
    flat = choices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel())).view(tokens, 2)
    counts = torch.bincount(flat, minlength=EXPERTS)
    mode = Mode(sync_free=True, records=True)
    rows = RoutedRows(order // 2, gates.reshape(-1)[order], Segments(counts), mode, position)
    assert choose(bank, rows.item.shape[0], items, counts, mode) == "grouped_mm"
    y = STEPS["grouped_mm"].combine(bank, items, rows, None)
    w1, b1, w2, b2 = bank.weights
    want = torch.stack([sum(gates[t, j] * F.linear(F.gelu(F.linear(items[t], w1[e], b1[e])), w2[e], b2[e])
                            for j, e in enumerate(choices[t].tolist())) for t in range(tokens)])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    for got, expected in zip(_gradients(y, items, bank), _gradients(want, items, bank), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)

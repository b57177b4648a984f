"""The expert bank's three expert steps (loop, padded bmm, grouped_mm) compute the same function and the
same gradients, for every FFN structure the adapters build."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moespec.layers import Experts, Mode, set_expert_step
from moespec.layers.routing import Groups, group_pairs
from moespec.layers.steps import STEPS, available_steps
from moespec.layers.steps.rows import RoutedRows, Segments

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
    set_expert_step(bank, dispatch)
    bank.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = bank(x, counts)
    (y * grad).sum().backward()
    grads = {name: p.grad for name, p in bank.named_parameters()}
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("dispatch", [s for s in available_steps() if s != "loop"])
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


@pytest.mark.parametrize("dispatch", available_steps())
def test_no_rows_gives_an_empty_output(dispatch):
    bank = _bank("plain")
    set_expert_step(bank, dispatch)
    assert bank(torch.zeros(0, 8), torch.zeros(4, dtype=torch.long)).shape == (0, 12)


def test_auto_picks_padded_grouped_mm_or_the_loop_by_rows_per_expert_and_padding_waste_on_cpu():
    from moespec.layers.steps.rule import CPU_LOOP_FROM

    def rows(*counts):
        counts = torch.tensor(counts)
        return torch.zeros(int(counts.sum()), 8), counts

    bank = _bank("plain")  # 4 experts, widths 8 -> 4 -> 12: every row 16-byte aligned in float32
    many = 4 * CPU_LOOP_FROM
    for grad in (True, False):  # past padded's bound: grouped_mm when a backward may follow, else the loop
        rowwise = "grouped_mm" if grad else "loop"
        with torch.set_grad_enabled(grad):
            assert bank.strategy(*rows(many, 0, 0, 0)) == "loop"  # a mean of 128 rows per expert, however uneven
            assert bank.strategy(*rows(*[CPU_LOOP_FROM] * 4)) == "loop"
            assert bank.strategy(*rows(*[CPU_LOOP_FROM - 1] * 4)) == "padded"  # even: no waste
            # padded while 4 x largest <= (1.5 + 10 / m - m / 256) x rows: at a mean of m = 100 rows per expert
            # 4 x 120 = 480 <= 600 + 40 - 156.25 = 483.75 (1.2x the mean), not 121
            assert bank.strategy(*rows(120, 94, 93, 93)) == "padded"
            assert bank.strategy(*rows(121, 93, 93, 93)) == rowwise
            # m = 20: 4 x 38 = 152 <= 120 + 40 - 6.25 = 153.75 (1.9x the mean), not 39
            assert bank.strategy(*rows(38, 20, 11, 11)) == "padded"
            assert bank.strategy(*rows(39, 19, 11, 11)) == rowwise
            # m = 5: few rows tolerate more waste, 4 x 17 = 68 <= 30 + 40 - 0.4 = 69.6 (3.4x the mean), not 18
            assert bank.strategy(*rows(17, 3, 0, 0)) == "padded"
            assert bank.strategy(*rows(18, 2, 0, 0)) == rowwise
            assert bank.strategy(*rows(0, 0, 0, 0)) == "padded"  # nothing to pad
    double = torch.zeros(100, 8, dtype=torch.float64)  # grouped_mm takes no float64: the loop instead
    assert bank.strategy(double, torch.tensor([100, 0, 0, 0])) == "loop"
    assert bank.strategy(double, torch.tensor([25, 25, 25, 25])) == "padded"
    odd = Experts(4, 6, 10, 6, act=nn.GELU())  # 6 floats = 24 bytes a row: grouped_mm's kernels refuse it
    assert odd.strategy(torch.zeros(100, 6), torch.tensor([100, 0, 0, 0])) == "loop"
    set_expert_step(bank, "padded")
    assert bank.strategy(*rows(10_000, 0, 0, 0)) == "padded"  # a forced step is taken as is
    grn = Experts(2, 6, 5, 6, act=nn.GELU(), inner_norm="grn")
    set_expert_step(grn, "padded")  # GRN normalizes per image: only the loop knows the images
    assert grn.strategy(torch.zeros(8, 6), torch.tensor([8, 0])) == "loop"


def test_auto_is_a_function_of_the_inputs_only():
    """Same inputs (shapes, dtype, counts), same step, so that a run is bit-reproducible: nothing is timed."""
    bank = _bank("plain")
    x = torch.randn(300, 8)
    counts = torch.tensor([100, 50, 100, 50])
    first = bank(x, counts)
    for _ in range(3):
        assert torch.equal(bank(x, counts), first)


@pytest.mark.parametrize("dispatch", available_steps())
def test_every_step_takes_an_expanded_output_gradient(dispatch):
    """`.sum().backward()` sends a stride-0 gradient, which torch's grouped_mm backward refuses by itself."""
    bank = _bank("plain")
    set_expert_step(bank, dispatch)
    x = torch.randn(11, 8, requires_grad=True)
    bank(x, torch.tensor([3, 0, 6, 2])).sum().backward()
    assert x.grad.shape == (11, 8) and bank.fc1.weight.grad is not None


def test_batched_equals_each_expert_on_its_own_rows():
    bank = _bank("layernorm")
    x = torch.randn(4, 3, 8)
    per_expert = torch.stack([bank.forward(x[e], torch.eye(4, dtype=torch.long)[e] * 3) for e in range(4)])
    torch.testing.assert_close(bank.batched(x), per_expert, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("structure", ["swiglu", "glu"])
@pytest.mark.parametrize("dispatch", available_steps())
def test_gated_product_without_autograd_is_the_recorded_one_bit_for_bit(structure, dispatch):
    """Without autograd the gated product goes into act's own output (mul_), in either GLU order."""
    bank = _bank(structure)
    set_expert_step(bank, dispatch)
    x, counts = torch.randn(11, 8), torch.tensor([3, 0, 6, 2])
    recorded = bank(x, counts)
    assert recorded.requires_grad
    with torch.no_grad():
        assert torch.equal(bank(x, counts), recorded.detach())


@pytest.mark.parametrize("dispatch", ["auto", *available_steps()])
def test_batched_runs_the_step_it_is_given_and_every_step_agrees(dispatch, monkeypatch):
    """Equal segments (Soft MoE's slots): each step gives the bmm's output and gradients; auto on CPU runs the
    bmm on x itself (nothing to pad) below CPU_EQUAL_LOOP_FROM rows per expert, the loop from there: 128 in a
    forward autograd does not record, 512 in one it does."""
    from moespec.layers.steps.rule import CPU_EQUAL_LOOP_FROM

    forward_from, backward_from = CPU_EQUAL_LOOP_FROM
    for rows in (3, forward_from, backward_from):
        bank = _bank("swiglu")
        x, grad = torch.randn(4, rows, 8), torch.randn(4, rows, 12)
        set_expert_step(bank, "padded")
        x_ref = x.clone().requires_grad_()
        y_ref = bank.batched(x_ref)
        (y_ref * grad).sum().backward()
        grads_ref = {name: p.grad.clone() for name, p in bank.named_parameters()}

        ran = []
        set_expert_step(bank, dispatch)
        for name in ("loop", "grouped_mm"):  # the steps of the table, and padded's two bmm on x itself
            step = STEPS[name]
            monkeypatch.setattr(step, "run",
                                lambda *a, f=type(step).run, o=step, s=name, r=ran: r.append(s) or f(o, *a))
        monkeypatch.setattr(bank, "stacked",
                            lambda *a, f=Experts.stacked, b=bank, r=ran: r.append("padded") or f(b, *a))
        with torch.no_grad():
            y_plain = bank.batched(x)
        bank.zero_grad(set_to_none=True)
        x = x.requires_grad_()
        y = bank.batched(x)
        (y * grad).sum().backward()
        expected = [dispatch] * 2 if dispatch != "auto" else [
            "loop" if rows >= forward_from else "padded", "loop" if rows >= backward_from else "padded"]
        assert ran == expected
        torch.testing.assert_close(y_plain, y_ref.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
        for name, g in grads_ref.items():
            torch.testing.assert_close(bank.get_parameter(name).grad, g, atol=1e-4, rtol=1e-4, msg=name)


def _by_hand(bank: Experts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each expert's FFN on its own rows with F.linear on its slice of the stacked weights (no expert step)."""
    outputs, start = [], 0
    for e, count in enumerate(counts):
        rows = x[start:start + count]
        start += count
        h = torch.nn.functional.linear(rows, bank.fc1.weight[e], None if bank.fc1.bias is None else bank.fc1.bias[e])
        if bank.glu is not None:
            a, b = h.chunk(2, dim=-1)
            h = bank.act(a) * b if bank.glu == "act_first" else a * bank.act(b)
        elif bank.inner_norm == "layernorm_before_act":
            h = bank.act(torch.nn.functional.layer_norm(h, h.shape[-1:], bank.norm.weight[e], bank.norm.bias[e],
                                                        bank.norm.eps))
        else:
            h = bank.act(h)
        if bank.inner_norm == "layernorm":
            h = torch.nn.functional.layer_norm(h, h.shape[-1:], bank.norm.weight[e], bank.norm.bias[e], bank.norm.eps)
        outputs.append(torch.nn.functional.linear(h, bank.fc2.weight[e],
                                                  None if bank.fc2.bias is None else bank.fc2.bias[e]))
    return torch.cat(outputs)


@pytest.mark.parametrize("dispatch", available_steps())
@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_every_step_matches_each_expert_by_hand_with_gradients(structure, dispatch):
    bank = _bank(structure)
    counts = [3, 0, 6, 2]
    x, grad = torch.randn(11, 8), torch.randn(11, 12)
    y, x_grad, grads = _run(bank, dispatch, x, torch.tensor(counts), grad)
    bank.zero_grad(set_to_none=True)
    x_ref = x.clone().requires_grad_()
    y_ref = _by_hand(bank, x_ref, counts)
    (y_ref * grad).sum().backward()
    torch.testing.assert_close(y, y_ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x_grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    for name, p in bank.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-4, rtol=1e-4, msg=name)
    assert grads["fc1.weight"][1].abs().max() == 0  # the expert without rows


def _grn_bank() -> Experts:
    torch.manual_seed(0)
    bank = Experts(4, 8, 4, 12, act=nn.GELU(), inner_norm="grn")
    for p in bank.parameters():
        nn.init.normal_(p, std=0.5)
    return bank


@pytest.mark.parametrize("structure", [*STRUCTURES, "grn"])
def test_the_loop_gives_the_same_output_with_and_without_autograd(structure):
    """The loop runs each expert's whole FFN on its segment in turn; under autograd each segment is a graph of
    its own (`SegmentGraphs`), without it plain ops: the same ops on the same rows, so the same bits."""
    bank = _grn_bank() if structure == "grn" else _bank(structure)
    set_expert_step(bank, "loop")
    counts = torch.tensor([3, 0, 6, 2])
    x, groups = torch.randn(11, 8), torch.tensor([0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 1])
    groups = groups if structure == "grn" else None
    with_grad = bank(x.requires_grad_(), counts, groups)
    assert type(with_grad.grad_fn).__name__ == "SegmentGraphsBackward"
    with torch.no_grad():
        without = bank(x, counts, groups)
    assert torch.equal(without, with_grad.detach())
    if structure != "grn":
        torch.testing.assert_close(without, _by_hand(bank, x.detach(), counts.tolist()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("structure", [*STRUCTURES, "grn"])
def test_combine_segment_by_segment_equals_the_gathered_step_and_the_sum_by_hand(structure):
    """Without autograd, under the loop, `combine` gathers, runs, scales and adds each expert's segment in turn;
    with autograd it runs the step on every gathered row, then scales and scatters. Both are the weighted sum
    over each item's pairs, by hand: items picked twice (top-2), an item in no pair (0), an expert with none."""
    bank = _grn_bank() if structure == "grn" else _bank(structure)
    set_expert_step(bank, "loop")
    items = torch.randn(7, 8)
    counts = torch.tensor([3, 0, 4, 2])  # pairs sorted by expert
    rows = torch.tensor([0, 2, 5, 1, 2, 3, 5, 0, 3])  # item 4 and item 6 in no pair
    weights = torch.rand(9)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1]) if structure == "grn" else None
    with torch.no_grad():
        mode = Mode.of(items, bank)
        assert bank.strategy(items[rows], counts) == "loop" and not mode.records and bank.transport.local
        segmentwise = bank.combine(items, RoutedRows(rows, weights, Segments(counts), mode), groups)
    items.requires_grad_()
    gathered = bank.combine(items, RoutedRows(rows, weights, Segments(counts), Mode.of(items, bank)), groups)
    assert gathered.requires_grad
    torch.testing.assert_close(segmentwise, gathered.detach(), atol=1e-6, rtol=1e-6)
    if structure != "grn":
        outputs = _by_hand(bank, items.detach()[rows], counts.tolist())
        by_hand = torch.zeros(7, 12).index_add_(0, rows, weights[:, None] * outputs)
        torch.testing.assert_close(segmentwise, by_hand, atol=1e-5, rtol=1e-5)
    assert segmentwise[4].eq(0).all() and segmentwise[6].eq(0).all()
    with torch.no_grad():  # no pair at all: zeros of the items' shape
        empty = bank.combine(items, RoutedRows(rows[:0], weights[:0], Segments(torch.zeros(4, dtype=torch.long)),
                                               Mode.of(items, bank)),
                             groups)
    assert torch.equal(empty, torch.zeros(7, 12))


@pytest.mark.parametrize("step", available_steps())
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_the_combine_by_gathers_equals_the_scatter_add_with_dropped_rows(step, grad):
    """Where each item's k rows are known (`position`), `combine` gathers and sums them (forward and backward),
    as the scatter-add over the rows computes it; the rows a capacity dropped follow the segments with weight 0
    and add nothing, on CPU too. Top-2 of 4 experts for 10 items, capacity 3: 20 choices, at most 12 kept."""
    torch.manual_seed(0)
    bank = set_expert_step(_bank("plain"), step)
    items = torch.randn(10, 8)
    choices = torch.randint(0, 4, (10, 2))
    choices[:, 1] = (choices[:, 0] + 1 + torch.randint(0, 3, (10,))) % 4  # two different experts per item
    gates = torch.rand(10, 2)
    pairs = group_pairs(choices, gates, 4, Mode(), capacity=[3, 3], groups=Groups(1, 10, 10))
    kept = int(pairs.counts.sum())
    assert pairs.dropped and pairs.position is not None and kept < 20 == pairs.item.numel()
    results = []
    for position in (pairs.position, None):
        x = items.clone().requires_grad_(grad)
        w = pairs.weights.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            y = bank.combine(x, RoutedRows(pairs.item, w, Segments(pairs.counts, True), Mode.of(x, bank), position))
        if grad:
            y.square().sum().backward()
        results.append((y.detach(), x.grad, w.grad))
    (gathered, *grads), (scattered, *expected) = results
    torch.testing.assert_close(gathered, scattered, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected, strict=True):
        if grad:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    by_hand = torch.zeros(10, 12)
    with torch.no_grad():
        outputs = _by_hand(bank, items[pairs.item[:kept]], pairs.counts.tolist())
        by_hand.index_add_(0, pairs.item[:kept], pairs.weights[:kept, None] * outputs)
    torch.testing.assert_close(gathered, by_hand, rtol=1e-5, atol=1e-5)


def test_the_loop_without_autograd_keeps_the_dropout_after_fc2():
    """The loop without autograd runs the whole FFN, the dropout after fc2 included: in training p = 1 drops
    everything, in eval it is the identity."""
    torch.manual_seed(0)
    bank = Experts(4, 8, 4, 12, act=nn.GELU(), drop=(0.0, 1.0))
    set_expert_step(bank, "loop")
    counts, x = torch.tensor([3, 0, 6, 2]), torch.randn(11, 8)
    with torch.no_grad():
        assert torch.equal(bank.train()(x, counts), torch.zeros(11, 12))
        torch.testing.assert_close(bank.eval()(x, counts), _by_hand(bank, x, counts.tolist()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("structure", ["plain", "swiglu", pytest.param("layernorm", marks=pytest.mark.slow),  # 13 s
                                       "grn"])
def test_the_loop_under_autograd_passes_gradcheck(structure):
    """Gradients of the input and of every stacked parameter, an expert without rows included."""
    bank = (_grn_bank() if structure == "grn" else _bank(structure)).double()
    set_expert_step(bank, "loop")
    names = [name for name, _ in bank.named_parameters()]
    counts, groups = torch.tensor([2, 0, 4, 1]), torch.tensor([0, 1, 0, 0, 1, 1, 0])

    def run(x, *params):
        return torch.func.functional_call(bank, dict(zip(names, params, strict=True)),
                                          (x, counts, groups if structure == "grn" else None))

    x = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in bank.parameters()]
    assert torch.autograd.gradcheck(run, (x, *params))


def test_the_loop_under_autograd_keeps_its_graph_when_asked_and_frees_it_otherwise():
    bank = _bank("plain")
    set_expert_step(bank, "loop")
    x, counts = torch.randn(11, 8, requires_grad=True), torch.tensor([3, 0, 6, 2])
    loss = bank(x, counts).square().sum()
    loss.backward(retain_graph=True)
    once = bank.fc1.weight.grad.clone()
    loss.backward()  # the segment graphs were kept: the same gradient again
    torch.testing.assert_close(bank.fc1.weight.grad, 2 * once)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_loop_under_activation_checkpointing_gives_the_same_gradients(reentrant):
    from torch.utils.checkpoint import checkpoint

    bank = _bank("layernorm")
    set_expert_step(bank, "loop")
    x, counts = torch.randn(11, 8, requires_grad=True), torch.tensor([3, 0, 6, 2])

    def gradients(run):
        bank.zero_grad(set_to_none=True)
        x.grad = None
        run().square().sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in bank.parameters()]

    plain = gradients(lambda: bank(x, counts))
    checkpointed = gradients(lambda: checkpoint(bank, x, counts, use_reentrant=reentrant))
    for a, b in zip(plain, checkpointed, strict=True):
        assert torch.equal(a, b)


def test_expert_linear_passes_gradcheck():
    from moespec.layers.ops.expert_autograd import ExpertLinear

    weight = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    padded = torch.randn(3, 2, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: ExpertLinear.apply(x, w, b, None, None), (padded, weight, bias))

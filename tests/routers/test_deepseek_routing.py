"""DeepSeek-V3's routing options on the top-k router (sigmoid scores, a route scale, group-limited top-k, the
aux-loss-free balancing bias) and Swin-MoE's learnable cosine temperature: each against a hand calculation."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from pydantic import ValidationError
from torch import nn

import moespec
from moespec.layers import Experts, ImageRouter, MoE, ProjectedGate, TopKRouter

from ..conftest import TINY_INPUT, TINY_VIT, make_spec


class FixedGate(nn.Module):
    """Logits are the first E features of each item: routing chosen by hand."""

    def __init__(self, experts: int):
        super().__init__()
        self.experts = experts

    def macs_per_item(self) -> int:
        return 0

    def forward(self, x):
        return x[:, : self.experts]


def _items(logits: list[list[float]]) -> torch.Tensor:
    """Items whose first E features are `logits`, and one more feature (the items are wider than E)."""
    rows = torch.tensor(logits)
    return torch.cat([rows, torch.zeros(len(rows), 1)], dim=1)


def _layer(router: TopKRouter, dim: int, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    bank = Experts(router.num_experts, dim, 6, dim, act=nn.GELU())
    for p in bank.parameters():
        nn.init.normal_(p, std=0.5)
    return MoE(router, bank)


def test_one_bias_update_by_hand():
    """4 experts, top-1. Two micro-batches choose experts 0, 0, 1 and 0, 2 (the loads of the step: 3, 1, 1, 0;
    mean 1.25), so with rate 0.1 the bias moves by 0.1 * sign(1.25 - load) = -0.1, +0.1, +0.1, +0.1."""
    router = TopKRouter(FixedGate(4), 4, 1, bias_rate=0.1)
    model = _layer(router, dim=5).train()
    model(_items([[5, 0, 0, 0], [4, 0, 0, 0], [0, 3, 0, 0]]))
    model(_items([[2, 0, 0, 0], [0, 0, 7, 0]]))
    assert router.balance.tokens_per_expert.tolist() == [3, 1, 1, 0]
    assert moespec.update_bias(model) == 1
    assert router.balance.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    assert router.balance.tokens_per_expert.tolist() == [0, 0, 0, 0]  # the next step counts afresh
    moespec.update_bias(model)  # a step without a training forward changes nothing
    assert router.balance.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])


def test_the_bias_chooses_and_the_unbiased_scores_weigh():
    """Softmax scores of logits [2, 1, 0]: 0.665, 0.245, 0.090. A bias of -0.5 on expert 0 makes its choice
    score 0.165 < 0.245: expert 1 is chosen, weighted by its unbiased score 0.245."""
    router = TopKRouter(FixedGate(3), 3, 1, bias_rate=0.01).train()
    router.balance.expert_bias.copy_(torch.tensor([-0.5, 0.0, 0.0]))
    routing = router(_items([[2.0, 1.0, 0.0]]))
    probs = torch.tensor([2.0, 1.0, 0.0]).softmax(dim=0)
    assert routing.expert.tolist() == [1]
    assert routing.weights.tolist() == pytest.approx([probs[1].item()])
    router.eval()  # eval ignores the bias
    assert router(_items([[2.0, 1.0, 0.0]])).expert.tolist() == [0]


def test_load_imbalance_falls_over_50_steps_without_an_aux_loss():
    """Every item prefers expert 0 (+1 on its logit); no aux loss, only the bias (updated by the optimizer hook)
    spreads the load: the largest load over the mean falls from about 4 (everything on one expert) to near 1."""
    torch.manual_seed(0)
    experts, dim = 4, 8
    router = TopKRouter(nn.Linear(dim, experts, bias=False), experts, 1, bias_rate=0.02)
    router.gate.macs_per_item = lambda: 0
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(experts, dim) * 0.3)
    model = _layer(router, dim).train()
    x = torch.randn(256, dim) * 0.5
    x[:, 0] += 3.0  # the skew
    optimizer = torch.optim.SGD(model.experts.parameters(), lr=1e-3)
    handle = moespec.update_bias_on_step(model, optimizer)
    imbalance = []
    for _ in range(50):
        out = model(x)
        counts = model.last_routing.counts.double()
        imbalance.append((counts.max() / counts.mean()).item())
        optimizer.zero_grad()
        out.square().mean().backward()  # a task loss; no moespec.aux_loss
        optimizer.step()
    handle.remove()
    assert imbalance[0] > 3.5
    assert max(imbalance[-10:]) < 1.5, imbalance
    assert router.balance.expert_bias[0] < 0 < router.balance.expert_bias[1:].min()


def test_eval_output_is_bit_equal_whatever_the_bias():
    torch.manual_seed(1)
    router = TopKRouter(nn.Linear(6, 4, bias=False), 4, 2, bias_rate=0.01, score="sigmoid", scale=2.5)
    router.gate.macs_per_item = lambda: 0
    model = _layer(router, 6)
    x = torch.randn(32, 6)
    reference = model.eval()(x)
    counts = router.balance.tokens_per_expert.clone()
    router.balance.expert_bias.copy_(torch.tensor([10.0, -10.0, 3.0, -3.0]))
    assert torch.equal(model.eval()(x), reference)
    assert torch.equal(router.balance.tokens_per_expert, counts)  # eval forwards are not loads of a training step
    assert not torch.equal(model.train()(x), reference)  # in training the bias does choose


def test_sigmoid_scores_renormalized_and_scaled_by_hand():
    logits = [[2.0, 1.0, -1.0, 0.0]]
    router = TopKRouter(FixedGate(4), 4, 2, score="sigmoid", scale=2.5)
    routing = router(_items(logits))
    s = torch.tensor(logits[0]).sigmoid()
    expected = {0: 2.5 * s[0] / (s[0] + s[1]), 1: 2.5 * s[1] / (s[0] + s[1])}
    assert sorted(routing.expert.tolist()) == [0, 1]
    assert {e: w for e, w in zip(routing.expert.tolist(), routing.weights.tolist(), strict=True)} == pytest.approx(
        {e: w.item() for e, w in expected.items()})
    assert routing.probs[0].tolist() == pytest.approx((s / s.sum()).tolist())  # what the aux losses read


def test_group_limited_top_k_by_hand():
    """8 experts in 4 groups of 2, keep the top 2 groups, top-2 among their experts. In units of e^x, the group
    scores (the sum of each group's two scores) are: group 0 e^3 + e^-5 = 20.1, group 1 2 e^2.5 = 24.4, group 3
    e^2.8 + e^2.7 = 31.3 (group 2 ~0): groups 3 and 1 are kept, so expert 0, the best alone, is not; the top-2 of
    experts 2, 3, 6, 7 are 6 and 7."""
    logits = torch.tensor([[3.0, -5, 2.5, 2.5, -5, -5, 2.8, 2.7]])
    router = TopKRouter(FixedGate(8), 8, 2, expert_groups=(4, 2))
    routing = router(_items(logits.tolist()))
    probs = logits.softmax(dim=-1)[0]
    assert routing.expert.tolist() == [6, 7]
    assert routing.weights.tolist() == pytest.approx([probs[6].item(), probs[7].item()])
    assert sorted(TopKRouter(FixedGate(8), 8, 2)(_items(logits.tolist())).expert.tolist()) == [0, 6]  # plain top-2


def test_plain_top_k_is_unchanged_by_the_new_options_at_their_defaults():
    torch.manual_seed(2)
    x = torch.randn(16, 5)
    plain = TopKRouter(FixedGate(4), 4, 2, normalize=True)(x)
    explicit = TopKRouter(FixedGate(4), 4, 2, normalize=True, score="softmax", scale=1.0, expert_groups=None)(x)
    assert torch.equal(plain.weights, explicit.weights) and torch.equal(plain.item, explicit.item)


def test_learnable_temperature_starts_at_swin_moe_values_and_is_clamped():
    gate = ProjectedGate(6, 4, proj_dim=3, temperature=0.5, learnable_temperature=True)
    assert gate.log_scale.item() == pytest.approx(math.log(2.0))  # 1 / 0.5
    x = torch.randn(5, 6)
    fixed = ProjectedGate(6, 4, proj_dim=3, temperature=0.5)
    fixed.load_state_dict({k: v for k, v in gate.state_dict().items() if k != "log_scale"})
    assert torch.allclose(gate(x), fixed(x))
    with torch.no_grad():
        gate.log_scale.fill_(10.0)  # a temperature of e^-10: clamped to 0.01
    fixed.temperature = 0.01
    assert torch.allclose(gate(x), fixed(x))
    gate(x).sum().backward()
    assert gate.log_scale.grad is not None
    assert gate.log_scale.grad.item() == 0.0  # above the clamp no gradient pushes it further


def test_learnable_temperature_survives_upcycling_and_is_a_parameter():
    spec = make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 4, "router": {
        "kind": "topk", "top_k": 2, "gate": {"kind": "cosine", "temperature": "learnable"}}}])
    model = moespec.create_model(spec)
    gate = next(iter(moespec.moe_layers(model).values())).router.gate
    assert gate.log_scale.item() == pytest.approx(math.log(2.0))  # upcycling drew the router afresh, not this
    assert any(name.endswith("router.gate.log_scale") for name, _ in model.named_parameters())
    assert "cosine(t=learnable)" in str(moespec.plan(spec))


def test_bias_is_a_buffer_saved_and_loaded(tmp_path):
    spec = make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 4, "aux_loss": [], "router": {
        "kind": "topk", "top_k": 2, "score": "sigmoid", "bias_balance": {"rate": 0.001},
        "groups": {"count": 2, "top": 1}}}])
    model = moespec.create_model(spec)
    router = next(iter(moespec.moe_layers(model).values())).router
    assert not any("expert_bias" in name for name, _ in model.named_parameters())  # not for the optimizer
    assert "tokens_per_expert" not in " ".join(model.state_dict())  # the step's accumulator is not saved
    router.balance.expert_bias.copy_(torch.tensor([0.25, -0.5, 0.125, 1.0]))
    loaded = moespec.load(moespec.save(model, tmp_path / "moe.safetensors"))
    loaded_router = next(iter(moespec.moe_layers(loaded).values())).router
    assert torch.equal(loaded_router.balance.expert_bias, router.balance.expert_bias)
    x = torch.randn(2, *TINY_INPUT)
    assert torch.equal(loaded.train()(x), model.train()(x))  # the bias chooses alike in training
    # the counts are each rank's own: DistributedDataParallel leaves alone the names the model lists for it
    # (test_ddp_bias.py runs it), in a built, a loaded and a copied model alike
    for each in model, loaded, copy.deepcopy(loaded):
        assert each._ddp_params_and_buffers_to_ignore == ["blocks.1.mlp.router.balance.tokens_per_expert"]



def test_a_meta_build_starts_its_counts_at_zero():
    """transformers builds on the meta device and then calls `init_non_persistent_buffers` where a module has it
    (timm's name): the counts, which no checkpoint holds, start at zero, not at the memory they were given."""
    spec = make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 4, "aux_loss": [], "router": {
        "kind": "topk", "top_k": 1, "bias_balance": {"rate": 0.001}}}])
    balance = next(iter(moespec.moe_layers(moespec.create_model(spec)).values())).router.balance
    balance.tokens_per_expert.fill_(7)
    balance.forwards = 3
    balance.init_non_persistent_buffers()
    assert balance.tokens_per_expert.tolist() == [0, 0, 0, 0] and balance.forwards == 0

def test_plan_describes_every_option():
    spec = make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 8, "aux_loss": [], "router": {
        "kind": "topk", "top_k": 2, "score": "sigmoid", "scale": 2.5, "bias_balance": {"rate": 0.001},
        "groups": {"count": 4, "top": 2}, "eval_top_k": 1, "capacity_factor": 1.25, "eval_capacity_factor": 2.0}}])
    text = str(moespec.plan(spec))
    for label in ("sigmoid", "scale=2.5", "groups=2/4", "bias-balance=0.001", "eval-k=1", "cf=1.25", "eval-cf=2.0"):
        assert label in text, (label, text)


@pytest.mark.parametrize(("router", "field", "message"), [
    ({"groups": {"count": 3, "top": 1}}, "groups", "groups.count (3) must divide experts (8)"),
    ({"groups": {"count": 4, "top": 5}}, "groups.top", "top (5) must be between 1 and count (4)"),
    ({"top_k": 4, "groups": {"count": 4, "top": 1}}, "top_k", "top_k (4) is more than the 2 experts"),
    ({"eval_top_k": 9}, "eval_top_k", "eval_top_k (9) must be between 1 and experts (8)"),
    ({"bias_balance": {"rate": 0}}, "bias_balance.rate", "greater than 0"),
    ({"scale": 1e9}, "scale", "less than or equal to 100"),
    ({"score": "tanh"}, "score", "'softmax' or 'sigmoid'"),
    ({"eval_capacity_factor": "dropless"}, "eval_capacity_factor", "dropless already"),
])
def test_spec_errors_name_the_field(router, field, message):
    with pytest.raises(moespec.SpecError) as info:
        make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 8, "router": {"kind": "topk", **router}}])
    problems = info.value.problems
    assert len(problems) == 1 and problems[0].path == f"moe.0.router.{field}", problems
    assert message in problems[0].message


def test_learnable_temperature_needs_a_projected_gate():
    with pytest.raises((moespec.SpecError, ValidationError), match="cosine and l2 gates only"):
        make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 4, "router": {
            "kind": "topk", "gate": {"kind": "linear", "temperature": "learnable"}}}])


def test_image_routing_takes_the_same_options_per_image():
    """Two images of 3 tokens; the gate reads each [CLS] (first token). Image 0's logits [2, 1, 0, -1], image 1's
    [0, 0, 3, 0]; sigmoid scores, scale 2, top-2 in 2 groups of 2 keeping 1: image 0 keeps group 0 (experts 0, 1),
    image 1 group 1 (experts 2, 3, the tie broken by topk). The bias counts one choice per image and expert."""
    cls = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.0], [0.0, 0.0, 3.0, 0.0, 0.0]])
    x = torch.cat([cls[:, None], torch.zeros(2, 2, 5)], dim=1).reshape(6, 5)
    router = ImageRouter(FixedGate(4), 4, 2, score="sigmoid", scale=2.0, expert_groups=(2, 1), bias_rate=0.5,
                         eval_top_k=1).train()
    routing = router(x, images=2)
    s0 = torch.tensor([2.0, 1.0]).sigmoid()
    assert sorted(set(zip(routing.item.tolist(), routing.expert.tolist(), strict=True))) == [
        (i, e) for i in range(3) for e in (0, 1)] + [(i, e) for i in range(3, 6) for e in (2, 3)]
    weights = {(i, e): w for i, e, w in zip(routing.item.tolist(), routing.expert.tolist(), routing.weights.tolist(),
                                            strict=True)}
    assert weights[(0, 0)] == pytest.approx(2.0 * (s0[0] / s0.sum()).item())
    assert router.balance.tokens_per_expert.tolist() == [1, 1, 1, 1]  # images, not tokens
    assert router.eval()(x, images=2).counts.sum().item() == 6  # eval_top_k 1: each token once
    assert router.experts_per_item(6, 2) == 1


def test_image_routing_options_in_the_spec_and_plan():
    spec = make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 4, "aux_loss": [], "router": {
        "kind": "image", "top_k": 2, "score": "sigmoid", "scale": 2.0, "groups": {"count": 2, "top": 1},
        "bias_balance": {"rate": 0.01}, "eval_top_k": 1}}])
    assert "image/cls/linear sigmoid scale=2 groups=1/2 bias-balance=0.01 eval-k=1" in str(moespec.plan(spec))
    model = moespec.create_model(spec)
    model(torch.randn(2, *TINY_INPUT))
    assert moespec.update_bias(model) == 1
    with pytest.raises(moespec.SpecError, match="top_k \\(2\\) is more than the 1 experts"):
        make_spec(TINY_VIT, [{"where": {"every": 2}, "experts": 4, "router": {
            "kind": "image", "top_k": 2, "groups": {"count": 4, "top": 1}}}])


def test_the_step_count_stays_exact_in_a_bfloat16_model():
    """The loads are integers: `model.to(torch.bfloat16)` leaves them alone (a bfloat16 count of 257 is 256)."""
    router = TopKRouter(FixedGate(2), 2, 1, bias_rate=0.1)
    model = _layer(router, dim=3).to(torch.bfloat16).train()
    for items in (200, 57):
        model(_items([[1.0, 0.0]] * items).to(torch.bfloat16))
    assert router.balance.tokens_per_expert.tolist() == [257, 0]

"""Each router kind on hand-made inputs: what it promises, exactly."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moespec.layers import ExpertChoiceRouter, Experts, ImageRouter, LinearGate, MoE, ProjectedGate, SoftMoE, TopKRouter


class FixedGate(nn.Module):
    """A gate whose logits are the first E features of the item: routing chosen by hand."""

    def __init__(self, experts: int):
        super().__init__()
        self.experts = experts
        self.weight = nn.Parameter(torch.zeros(()))  # something for gradients to reach

    def macs_per_item(self) -> int:
        return 0

    def forward(self, x):
        return x[:, : self.experts] * (1 + self.weight)


def _bank(experts=3, dim=4, hidden=5, seed=0):
    torch.manual_seed(seed)
    bank = Experts(experts, dim, hidden, dim, act=nn.GELU())
    for p in bank.parameters():
        nn.init.normal_(p, std=0.5)
    return bank


def test_capacity_counts_and_order_without_bpr():
    # 6 items, 3 experts, top-1: items 0..4 prefer expert 0, item 5 prefers expert 1.
    logits = torch.tensor([[5.0, 0, 0], [4, 0, 0], [9, 0, 0], [3, 0, 0], [8, 0, 0], [0, 5, 0]])
    router = TopKRouter(FixedGate(3), 3, 1, capacity_factor=1.0)
    routing = router(torch.cat([logits, torch.zeros(6, 1)], dim=1))
    assert router.capacity(6) == math.ceil(1.0 * 1 * 6 / 3) == 2
    assert routing.counts.tolist() == [2, 1, 0]
    assert routing.item.tolist()[:3] == [0, 1, 5]  # expert 0 keeps the first two items in position order
    assert routing.kept.tolist() == [True, True, False, False, False, True]
    # the dropped choices follow the segments with weight 0, so that every item keeps its row (`position`)
    assert routing.dropped and sorted(routing.item.tolist()[3:]) == [2, 3, 4] and routing.weights[3:].eq(0).all()
    assert sorted(routing.position.view(-1).tolist()) == list(range(6))


def test_bpr_keeps_the_items_with_the_highest_gate():
    logits = torch.tensor([[5.0, 0, 0], [4, 0, 0], [9, 0, 0], [3, 0, 0], [8, 0, 0], [0, 5, 0]])
    router = TopKRouter(FixedGate(3), 3, 1, capacity_factor=1.0, bpr=True)
    routing = router(torch.cat([logits, torch.zeros(6, 1)], dim=1))
    assert routing.counts.tolist() == [2, 1, 0]
    assert routing.item.tolist()[:3] == [2, 4, 5]  # softmax top-1 values order 2 (9) > 4 (8) > 0 (5) > ...


def test_capacity_fills_first_choices_before_second_choices():
    # top-2 of 3 experts; everyone's second choice is expert 1, item 3's first choice is expert 1
    logits = torch.tensor([[5.0, 1, 0], [5, 1, 0], [5, 1, 0], [1, 5, 0]])
    router = TopKRouter(FixedGate(3), 3, 2, capacity_factor=0.75)  # ceil(0.75 * 2 * 4 / 3) = 2
    routing = router(torch.cat([logits, torch.zeros(4, 1)], dim=1))
    assert routing.counts.tolist() == [2, 2, 0]
    segments = routing.item[:4].split(routing.counts.tolist())
    assert segments[0].tolist() == [0, 1]  # expert 0: first choices in position order (item 3 picks it second)
    assert segments[1].tolist() == [3, 0]  # expert 1: item 3's first choice beats the others' second choices


def test_importance_score_routing_drops_exactly_the_fraction_with_lowest_top1():
    torch.manual_seed(0)
    x = torch.randn(20, 4)
    router = TopKRouter(FixedGate(3), 3, 1, drop_fraction=0.1)
    routing = router(x)
    top1 = x[:, :3].softmax(-1).max(-1).values
    lowest = set(top1.argsort()[:2].tolist())  # floor(0.1 * 20) = 2 rows
    assert set((~routing.kept).nonzero().squeeze(1).tolist()) == lowest
    assert routing.counts.sum().item() == 18 and router.dispatched(20) == 18 and router.experts_per_item(20, 1) == 1


def test_image_routing_sends_every_token_of_an_image_to_the_same_experts():
    torch.manual_seed(0)
    images, tokens, dim = 3, 5, 4
    x = torch.randn(images * tokens, dim)
    router = ImageRouter(LinearGate(dim, 4), 4, 2, pool="cls")
    routing = router(x, images)
    assert routing.probs.shape == (3, 4)  # one decision per image
    chosen = torch.zeros(images * tokens, 4, dtype=torch.bool)
    for expert, rows in enumerate(routing.item.split(routing.counts.tolist())):
        chosen[rows, expert] = True
    for image in range(images):
        block = chosen[image * tokens : (image + 1) * tokens]
        assert (block == block[0]).all() and block[0].sum() == 2
    # the decision reads the [CLS] token (first of each image) only
    expected = router.gate(x.reshape(images, tokens, dim)[:, 0]).softmax(-1).topk(2).indices
    assert [sorted(e) for e in expected.tolist()] == [sorted(chosen[i * tokens].nonzero().squeeze(1).tolist())
                                                      for i in range(images)]


def test_expert_choice_takes_exactly_c_tokens_per_expert():
    torch.manual_seed(0)
    x = torch.randn(12, 6)
    router = ExpertChoiceRouter(LinearGate(6, 4), 4, capacity=2.0)
    routing = router(x)
    assert router.capacity(12) == round(2.0 * 12 / 4) == 6
    assert routing.counts.tolist() == [6, 6, 6, 6]
    probs = router.gate(x).softmax(-1)
    for expert, rows in enumerate(routing.item.split(6)):
        assert set(rows.tolist()) == set(probs[:, expert].topk(6).indices.tolist())


def test_soft_moe_dispatch_and_combine_are_convex_and_drop_nothing():
    torch.manual_seed(0)
    layer = SoftMoE(_bank(experts=3, dim=4), slots_per_expert=2)
    tokens = torch.randn(2, 7, 4)
    dispatch, combine = layer.weights(tokens)
    torch.testing.assert_close(dispatch.sum(dim=1), torch.ones(2, 6))  # each slot: convex over tokens
    torch.testing.assert_close(combine.sum(dim=2), torch.ones(2, 7))  # each token: convex over slots
    assert (dispatch > 0).all() and (combine > 0).all()  # every token reaches every slot: no drops
    y = layer(tokens)
    assert y.shape == (2, 7, 4) and layer.routing_stats()["drop_fraction"] == 0.0
    # reference: slots -> experts by hand
    slots = torch.einsum("bns,bnc->bsc", dispatch, tokens)
    out = torch.stack([torch.stack([_expert(layer.experts, s // 2, slots[b, s]) for s in range(6)]) for b in range(2)])
    torch.testing.assert_close(y, torch.einsum("bns,bsc->bnc", combine, out), atol=1e-5, rtol=1e-5)


def _expert(bank, e, x):
    h = torch.nn.functional.gelu(x @ bank.fc1.weight[e].t() + bank.fc1.bias[e])
    return h @ bank.fc2.weight[e].t() + bank.fc2.bias[e]


@pytest.mark.parametrize("kind", ["topk-cosine", "topk-l2", "topk-noise", "image", "expert_choice", "soft"])
def test_gradients_reach_the_gate_and_every_used_expert(kind):
    torch.manual_seed(0)
    dim, experts = 4, 3
    bank = _bank(experts, dim)
    if kind == "soft":
        layer = SoftMoE(bank, 1)
        gate_params = [layer.phi, layer.scale]
    else:
        gate = ProjectedGate(dim, experts, 2, 0.5, metric=kind.split("-")[1]) if kind.startswith("topk-") and \
            kind != "topk-noise" else LinearGate(dim, experts)
        router = {"image": lambda: ImageRouter(gate, experts, 1),
                  "expert_choice": lambda: ExpertChoiceRouter(gate, experts, capacity=1.0)}.get(
            kind, lambda: TopKRouter(gate, experts, 2, noise_std=1 / experts if kind == "topk-noise" else 0.0))()
        layer = MoE(router, bank, aux_loss_weights={"importance_load": 0.01, "z_loss": 0.001})
        gate_params = list(gate.parameters())
    layer.train()
    x = torch.randn(2, 6, dim)
    y = layer(x)
    loss = y.square().mean() + (layer.weighted_aux_loss() or 0)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gate_params)
    stats = layer.routing_stats()
    for expert, count in enumerate(stats["tokens_per_expert"]):
        assert (bank.fc1.weight.grad[expert].abs().sum() > 0) == (count > 0)
    assert 0.0 <= stats["drop_fraction"] <= 1.0 and 0.0 < stats["mean_top1_gate"] <= 1.0


def test_noise_is_training_only_and_load_is_smooth():
    torch.manual_seed(0)
    router = TopKRouter(LinearGate(4, 3), 3, 1, noise_std=1 / 3)
    nn.init.normal_(router.gate.weight, std=1.0)
    x = torch.randn(50, 4)
    router.eval()
    assert torch.equal(router(x).item, router(x).item)
    router.train()
    routing = router(x)
    assert routing.load.requires_grad and not torch.equal(routing.load, routing.load.round())
    assert routing.load.sum().item() == pytest.approx(50, rel=0.2)  # about one expert per item


def _layers(dim: int = 4) -> dict[str, nn.Module]:
    """One MoE layer of every built-in router kind (and the options that group, drop and normalize), GRN experts
    too. (The opt-in hash router: tests/routers/test_hash.py.)"""

    def gate():
        return LinearGate(dim, 3)

    grn = Experts(3, dim, 6, dim, act=nn.GELU(), inner_norm="grn")
    return {
        "topk": MoE(TopKRouter(gate(), 3, 2, noise_std=0.3), _bank(dim=dim), _bank(1, dim=dim)),
        "topk_capacity_batch": MoE(TopKRouter(gate(), 3, 2, capacity_factor=1.0, bpr=True, group=None), _bank(dim=dim)),
        "topk_drop": MoE(TopKRouter(ProjectedGate(dim, 3), 3, 1, drop_fraction=0.5), _bank(dim=dim)),
        "image_cls": MoE(ImageRouter(gate(), 3, 1, pool="cls"), _bank(dim=dim)),
        "image_mean": MoE(ImageRouter(gate(), 3, 2, pool="mean", normalize=True), _bank(dim=dim)),
        "expert_choice": MoE(ExpertChoiceRouter(gate(), 3, group=None), _bank(dim=dim)),
        "grn": MoE(TopKRouter(gate(), 3, 1), grn),
        "soft": SoftMoE(_bank(dim=dim), 2, _bank(1, dim=dim)),
        "soft_grn": SoftMoE(Experts(3, dim, 6, dim, act=nn.GELU(), inner_norm="grn"), 1),
    }


@pytest.mark.parametrize("images, tokens, training", [(0, 5, True), (0, 5, False), (3, 1, True)],
                         ids=["empty_batch_train", "empty_batch_eval", "one_token"])
def test_every_layer_takes_an_empty_batch_and_one_token_as_the_dense_ffn_does(images, tokens, training):
    """[0, N, C] -> [0, N, C] and [B, 1, C] -> [B, 1, C], forward and backward, with finite aux losses, as a
    dense FFN; the same for [B, C, H, W] maps."""
    for name, layer in _layers().items():
        layer.train(training)
        x = torch.randn(images, tokens, 4, requires_grad=True)
        y = layer(x)
        assert y.shape == x.shape, name
        losses = list(layer.aux_losses.values())
        assert all(torch.isfinite(loss) for loss in losses), name
        (y.sum() + sum(losses)).backward()
        assert x.grad.shape == x.shape and all(torch.isfinite(p.grad).all() for p in layer.parameters()
                                                if p.grad is not None), name
        layer.channels_dim = 1
        assert layer(torch.randn(images, 4, tokens, 2)).shape == (images, 4, tokens, 2), name


def test_a_bias_step_passes_over_soft_moe_layers():
    """`update_bias` steps the routers with a balancing bias and passes over layers without a router (Soft MoE):
    a model that mixes them (the expert-parallel check's) stepped no layer and raised AttributeError."""
    import moespec

    model = nn.Sequential(SoftMoE(_bank(experts=3, dim=4), slots_per_expert=2))
    model(torch.randn(2, 5, 4))
    assert moespec.update_bias(model) == 0

"""moespec.merge: experts that compute the same function merge into it (exact under a normalized router), the
alignment is what makes that so, and the groups follow similarity."""

from __future__ import annotations

import re

import pytest
import torch

import moespec
from moespec.compress import merge, merge_with_report
from moespec.errors import MoespecError

from .conftest import tiny_spec


def same_function_experts(model, shuffle: bool) -> None:
    """Every expert of block 1 a copy of expert 0, with its hidden units in another order when `shuffle`: the
    same function, other weights."""
    bank = model.blocks[1].mlp.experts
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for e in range(1, bank.num_experts):
            order = torch.randperm(bank.hidden, generator=generator) if shuffle else torch.arange(bank.hidden)
            bank.fc1.weight[e] = bank.fc1.weight[0][order]
            bank.fc1.bias[e] = bank.fc1.bias[0][order]
            bank.fc2.weight[e] = bank.fc2.weight[0][:, order]
            bank.fc2.bias[e] = bank.fc2.bias[0]


@pytest.mark.parametrize("shuffle", [False, True], ids=["identical", "permuted"])
def test_merging_experts_of_one_function_under_a_normalized_router_changes_no_output(images, shuffle):
    model = moespec.create_model(tiny_spec(experts=4, top_k=2, normalize=True), seed=0).eval()
    with torch.no_grad():
        model.blocks[1].mlp.experts.fc1.bias.normal_()  # non-zero biases: they must be aligned too
    same_function_experts(model, shuffle)
    before = model(images)
    merged, report = merge_with_report(model, images, into=2)
    assert merged.blocks[1].mlp.num_experts == 2
    assert torch.allclose(merged.eval()(images), before, rtol=0, atol=1e-5)
    assert report.top1_agreement == 1.0
    other = torch.randn(2, 3, 32, 32)
    assert torch.allclose(merged(other), model(other), rtol=0, atol=1e-5)


def test_without_alignment_permuted_experts_do_not_average_to_their_function(images):
    """The control of the permuted case: the plain average of the shuffled copies is another function, so the
    test above holds only because the units were matched."""
    model = moespec.create_model(tiny_spec(experts=4, top_k=2, normalize=True), seed=0).eval()
    same_function_experts(model, shuffle=True)
    before = model(images)
    with torch.no_grad():
        bank = model.blocks[1].mlp.experts
        for tensor in (bank.fc1.weight, bank.fc1.bias, bank.fc2.weight, bank.fc2.bias):
            tensor.copy_(tensor.mean(0, keepdim=True).expand_as(tensor))
    assert not torch.allclose(model(images), before, atol=1e-3)


def test_groups_follow_the_experts_outputs(images):
    """Experts 0 and 2 copies of one FFN, 1 and 3 of another: merged into 2, the groups are {0, 2} and {1, 3}."""
    model = moespec.create_model(tiny_spec(experts=4, top_k=1), seed=0).eval()
    bank = model.blocks[1].mlp.experts
    with torch.no_grad():
        for tensor in (bank.fc1.weight, bank.fc1.bias, bank.fc2.weight, bank.fc2.bias):
            tensor.normal_(std=0.05)
            tensor[2], tensor[3] = tensor[0], tensor[1]
    merged, report = merge_with_report(model, images, into=2)
    assert report.layers[0].sources == [[0, 2], [1, 3]]
    assert torch.allclose(merged.blocks[1].mlp.experts.fc1.weight[0], bank.fc1.weight[0])
    assert torch.allclose(merged.blocks[1].mlp.experts.fc1.weight[1], bank.fc1.weight[1])
    # the fitted router sends each item to the group its old top-1 was in, for (nearly) every sampled item
    note = next(note for note in report.notes if note.startswith("blocks.1.mlp: the router's top-1"))
    after, before = (float(x) for x in re.findall(r"([0-9.]+)% ", note))
    assert after >= before and after >= 90.0, note


def test_merge_weights_by_usage(images):
    """Two different experts, one group: the merged expert is their load-weighted average (after alignment
    to the most used one; experts whose units already line up are not reordered)."""
    model = moespec.create_model(tiny_spec(experts=2, top_k=1), seed=0).eval()
    merged, report = merge_with_report(model, images, into=1, fit=False)
    load = torch.tensor(report.layers[0].load_before, dtype=torch.float64)
    old = model.blocks[1].mlp.experts.fc2.bias.double()
    assert torch.allclose(merged.blocks[1].mlp.experts.fc2.bias[0].double(), load @ old, atol=1e-6)
    rows = model.blocks[1].mlp.router.gate.weight.double()
    assert torch.allclose(merged.blocks[1].mlp.router.gate.weight[0].double(), load @ rows, atol=1e-6)


def test_merge_refuses_into_below_top_k(images):
    model = moespec.create_model(tiny_spec(experts=4, top_k=2), seed=0)
    with pytest.raises(MoespecError, match=r"merge: into 1 is fewer than the 2 experts each item uses in blocks.1.mlp"):
        merge(model, images, into=1)

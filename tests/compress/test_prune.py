"""moespec.prune: the exact guarantees on hand-built models, the choice of experts, the spec and its counts."""

from __future__ import annotations

import pytest
import torch

import moespec
from moespec.compress import prune, prune_with_report
from moespec.errors import MoespecError

from .conftest import never_choose, tiny_spec


def test_pruning_experts_no_image_routes_to_changes_no_output(images):
    model = moespec.create_model(tiny_spec(experts=4, top_k=2), seed=0).eval()
    never_choose(model, [1, 3])
    before = model(images)
    pruned = prune(model, images, keep=2)
    assert pruned.blocks[1].mlp.num_experts == 2
    assert torch.allclose(pruned.eval()(images), before, rtol=0, atol=1e-5)
    # the kept experts are 0 and 2, in order: their weights and router rows are the old ones
    old, new = model.blocks[1].mlp, pruned.blocks[1].mlp
    assert torch.equal(new.experts.fc1.weight, old.experts.fc1.weight[[0, 2]])
    assert torch.equal(new.router.gate.weight, old.router.gate.weight[[0, 2]])
    # on other inputs too (the unused experts are never chosen by construction)
    other = torch.randn(3, 3, 32, 32)
    assert torch.allclose(pruned(other), model(other), rtol=0, atol=1e-5)


def test_the_unused_experts_go_wherever_they_are(images):
    model = moespec.create_model(tiny_spec(experts=4, top_k=2), seed=0).eval()
    never_choose(model, [0, 3])
    pruned, report = prune_with_report(model, images, keep=2)
    assert report.layers[0].sources == [[1], [2]]
    assert report.layers[0].load_before[0] == report.layers[0].load_before[3] == 0.0
    assert report.top1_agreement == 1.0 and report.relative_logit_error < 1e-6
    assert torch.allclose(pruned.eval()(images), model(images), rtol=0, atol=1e-5)


def test_removing_used_experts_changes_the_output(images):
    """The control of the exact tests: where every expert is used, pruning does change the logits."""
    model = moespec.create_model(tiny_spec(experts=4, top_k=2), seed=0).eval()
    pruned, report = prune_with_report(model, images, keep=2)
    assert min(report.layers[0].load_before) > 0
    assert not torch.allclose(pruned.eval()(images), model(images), atol=1e-5)
    assert report.relative_logit_error > 1e-4


def test_the_model_given_is_left_untouched(images):
    model = moespec.create_model(tiny_spec(), seed=0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pruned = prune(model, images, keep=2)
    assert model.training and pruned.training
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert model.moespec_spec.moe[0].experts == 4 and pruned.moespec_spec.moe[0].experts == 2
    assert type(pruned) is type(model)


def test_the_pruned_spec_drops_exactly_the_removed_experts_and_router_rows(images):
    """Hand count for the tiny ViT (C = 96, H = 384): one expert is fc1 (C*H + H) + fc2 (H*C + C) =
    36,864 + 384 + 36,864 + 96 = 74,208 parameters; one linear gate row is C = 96."""
    model = moespec.create_model(tiny_spec(experts=4, top_k=1), seed=0)
    pruned = prune(model, images, keep=1)
    removed = 3 * (74_208 + 96)
    before, after = moespec.stats(model.moespec_spec), moespec.stats(pruned.moespec_spec)
    assert before.total_params - after.total_params == removed
    assert (sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in pruned.parameters())) == removed


def test_the_checkpoint_of_a_pruned_model_loads_into_its_spec(tmp_path, images):
    model = moespec.create_model(tiny_spec(), seed=0)
    pruned = prune(model, images, keep=0.5)
    moespec.save(pruned, tmp_path / "p.safetensors")
    loaded = moespec.load(tmp_path / "p.safetensors").eval()
    assert loaded.moespec_spec.moe[0].experts == 2
    assert torch.equal(loaded(images), pruned.eval()(images))


@pytest.mark.parametrize("keep, message", [
    (5, "keep 5 is more than the 4 experts of blocks.1.mlp (moe.0)"),
    (1, "keep 1 is fewer than the 2 experts each item uses in blocks.1.mlp (moe.0) (top_k)"),
    (0.1, "keep 0 is fewer than the 2"),
    (0, "keep must be a number of experts"),
])
def test_a_bad_keep_is_one_clear_error(images, keep, message):
    model = moespec.create_model(tiny_spec(), seed=0)
    with pytest.raises(MoespecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        prune(model, images, keep=keep)


def test_a_head_changed_after_the_build_is_kept(images):
    """A fine-tune's `reset_classifier` (5 classes, average pooling) is in the new model and in its spec."""
    model = moespec.create_model(tiny_spec(), seed=0).eval()
    model.reset_classifier(5, global_pool="avg")
    pruned = prune(model, images, keep=2)
    assert pruned.num_classes == 5 and pruned.global_pool == "avg"
    assert pruned.moespec_spec.backbone.kwargs["num_classes"] == 5
    assert pruned.eval()(images).shape == (6, 5)
    dense = moespec.densify(model)
    assert dense.num_classes == 5 and dense.global_pool == "avg"

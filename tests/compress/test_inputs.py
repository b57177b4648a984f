"""What every operation refuses, and the inputs it takes: image folders with unreadable files, tensors of the
wrong shape, layers where an operation does not apply; image routing; the cost measured on other images."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import moespec
from moespec.compress import densify, merge, prune, prune_with_report
from moespec.errors import MoespecError

from .conftest import tiny_spec


def with_router(router: dict, experts: int = 4) -> moespec.Spec:
    document = tiny_spec(experts=experts).model_dump(mode="json")
    document["moe"][0]["router"] = router
    document["moe"][0]["aux_loss"] = []
    return moespec.load_spec(document)


def test_a_folder_of_unreadable_images_is_one_clear_error(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    model = moespec.create_model(tiny_spec(), seed=0)
    with pytest.raises(MoespecError, match=r"no readable images \(1 file\(s\) could not be read; first: .*broken.png"):
        prune(model, tmp_path, keep=2)
    with pytest.raises(MoespecError, match=r"empty: no such folder of images"):
        prune(model, tmp_path / "empty", keep=2)


def test_a_folder_is_read_with_the_models_transform_and_unreadable_files_skipped(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (50, 40, 3), dtype=np.uint8)).save(tmp_path / f"{i}.jpg")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    _, report = prune_with_report(moespec.create_model(tiny_spec(), seed=0), tmp_path, keep=3)
    assert report.images == 3


def test_a_tensor_must_be_a_batch_of_images():
    model = moespec.create_model(tiny_spec(), seed=0)
    with pytest.raises(MoespecError, match=r"images: a batch \[B, C, H, W\] of at least one image is needed"):
        prune(model, torch.zeros(3, 32, 32), keep=2)


@pytest.mark.parametrize("router, operation, why", [
    ({"kind": "soft"}, prune, "Soft MoE, moe.0\\) cannot be pruned: every expert's slots mix all the tokens"),
    ({"kind": "expert_choice"}, prune, "expert choice, moe.0\\) cannot be pruned: each expert picks its own"),
    ({"kind": "topk", "top_k": 1, "groups": {"count": 2, "top": 1}}, merge,
     "cannot be merged: group-limited top-k"),
])
def test_layers_where_an_operation_does_not_apply_say_why(images, router, operation, why):
    model = moespec.create_model(with_router(router), seed=0)
    with pytest.raises(MoespecError, match=why):
        operation(model, images, 2)


def test_soft_moe_is_not_densified(images):
    model = moespec.create_model(with_router({"kind": "soft"}), seed=0)
    with pytest.raises(MoespecError, match=r"densify: blocks.1.mlp \(Soft MoE\) cannot be densified: its experts see "
                                           r"slots that mix all the tokens"):
        densify(model, images)


def test_image_routing_prunes_and_merges(images):
    model = moespec.create_model(with_router({"kind": "image", "top_k": 1}), seed=0).eval()
    for operation, count in ((prune, 2), (merge, 2)):
        new = operation(model, images, count)
        assert new.blocks[1].mlp.num_experts == 2 and new.blocks[1].mlp.router.gate.weight.shape[0] == 2
        assert new.eval()(images).shape == (6, 10)


def test_the_cost_is_measured_on_the_images_given_for_it(images):
    model = moespec.create_model(tiny_spec(), seed=0)
    _, report = prune_with_report(model, images, keep=2, compare_on=images[:2])
    assert report.images == 2


def test_the_public_api_names_them():
    import moespec.compress

    assert (moespec.prune, moespec.merge, moespec.densify) == (
        moespec.compress.prune, moespec.compress.merge, moespec.compress.densify)


def test_experts_with_a_folded_batchnorm_are_not_densified(images):
    spec = moespec.load_spec({"backbone": {"model": "repvit_m0_9", "kwargs": {"num_classes": 10}},
                              "input_size": [3, 64, 64],
                              "moe": [{"where": {"last": 1}, "experts": 2, "router": {"normalize": True}}]})
    with pytest.raises(MoespecError, match=r"the RepVitMlp experts are not a selection of the dense FFN's weights "
                                           r"\(upcycling folds a BatchNorm into their projections\)"):
        densify(moespec.create_model(spec, seed=0))

"""Routers started from data (`router_init: hidden | kmeans`) and Drop-Upcycling (`drop: r`), against hand
calculations."""

from __future__ import annotations

import math

import pytest
import torch

import moespec
from moespec.errors import SpecError
from moespec.weights.router_start import StreamingKMeans

from .test_upcycle_sources import INPUT, SMALL, spec_of, two_sources

TWO = [{"where": {"every": 1}, "experts": 2, "router": {"top_k": 1}}]


def coloured(channel: int, count: int, seed: int) -> torch.Tensor:
    """`count` images whose `channel` is 2 and the others 0, plus N(0, 0.1^2) noise."""
    x = 0.1 * torch.randn(count, *INPUT, generator=torch.Generator().manual_seed(seed))
    x[:, channel] += 2
    return x


def recorded_ffn_inputs(dense: torch.nn.Module, path: str, images: torch.Tensor) -> torch.Tensor:
    """The inputs of the dense FFN at `path` over `images`, as rows [items, C] (a ViT's Mlp has no `pre`)."""
    seen = []
    hook = dense.get_submodule(path).register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.no_grad():
        dense.eval()(images)
    hook.remove()
    return torch.cat(seen).reshape(-1, seen[0].shape[-1])


def test_a_hidden_row_points_along_the_mean_of_the_recorded_inputs(dense_checkpoint):
    """Row e = m / |m| * 0.02 * sqrt(C), m the mean of the FFN's inputs over expert e's source's images (all
    tokens, 17 per image, in images of 16 per batch: 20 images, two batches), C = 32."""
    paths, _ = two_sources(dense_checkpoint)
    images = [coloured(0, 20, 0), coloured(2, 20, 1)]
    spec = spec_of(TWO, router_init="hidden")
    state = moespec.upcycle(spec, paths, images=images).state_dict()
    base = moespec.weights.dense_model(spec, paths[0])[0]  # the base model reads the images (mergekit does too)
    for block in (0, 1):
        path = f"blocks.{block}.mlp"
        for expert, set_images in enumerate(images):
            inputs = recorded_ffn_inputs(base, path, set_images)
            assert inputs.shape == (20 * 17, 32)
            mean = inputs.mean(dim=0)
            expected = mean / mean.norm() * 0.02 * math.sqrt(32)
            torch.testing.assert_close(state[f"{path}.router.gate.weight"][expert], expected, rtol=0, atol=1e-6)


def test_each_sources_images_route_to_its_own_expert(dense_checkpoint):
    """Two sources whose FFNs differ, red images for source 0 and blue ones for source 1: in the first MoE layer
    (whose input is the base model's exactly), every token of a red image goes to expert 0, and of a blue image
    to expert 1; image-level routing sends every image (all its tokens) to its source's expert."""
    paths, (a, b) = two_sources(dense_checkpoint)
    assert not torch.equal(a["blocks.0.mlp.fc1.weight"], b["blocks.0.mlp.fc1.weight"])
    images = [coloured(0, 8, 0), coloured(2, 8, 1)]
    tests = [coloured(0, 4, 10), coloured(2, 4, 11)]  # images the rows were not made from
    for router in ({"top_k": 1}, {"kind": "image", "top_k": 1}):
        moe = [{"where": {"every": 1}, "experts": 2, "router": router}]
        model = moespec.upcycle(spec_of(moe, router_init="hidden"), paths, images=images).eval()
        for expert, x in enumerate(tests):
            with torch.no_grad():
                model(x)
            counts = model.blocks[0].mlp.routing_stats()["tokens_per_expert"]
            assert counts[expert] == 4 * 17 and sum(counts) == 4 * 17, (router, counts)  # 4 images of 17 tokens


def test_kmeans_rows_are_deterministic_unit_centroids(dense_checkpoint):
    path, _ = dense_checkpoint(SMALL)
    images = torch.randn(20, *INPUT, generator=torch.Generator().manual_seed(0))
    moe = [{"where": {"every": 1}, "experts": 4, "router": {"top_k": 1}}]
    spec = spec_of(moe, router_init="kmeans")
    first, again = (moespec.upcycle(spec, path, images=images, seed=7).state_dict() for _ in range(2))
    other = moespec.upcycle(spec, path, images=images, seed=8).state_dict()
    gate = first["blocks.0.mlp.router.gate.weight"]
    assert torch.equal(gate, again["blocks.0.mlp.router.gate.weight"])
    assert not torch.equal(gate, other["blocks.0.mlp.router.gate.weight"])  # another k-means++ seeding
    torch.testing.assert_close(gate.norm(dim=1), torch.full((4,), 0.02 * math.sqrt(32)))
    assert torch.linalg.matrix_rank(gate) == 4  # four different centroids


def test_streaming_kmeans_moves_each_centroid_to_the_running_mean_of_its_items():
    """Seeded by the first two items (k-means++ must take both: the second draw has weight 0 on the first);
    then (0, 2) joins (0, 0): centroid (0, 1); (10, 4) and (10, 2) join (10, 0): centroid (10, 2)."""
    kmeans = StreamingKMeans(2, torch.Generator().manual_seed(0), spherical=False)
    kmeans.add(0, torch.tensor([[0.0, 0.0], [10.0, 0.0]]))
    kmeans.add(0, torch.tensor([[0.0, 2.0], [10.0, 4.0], [10.0, 2.0]]))
    centroids = sorted(kmeans.result("test").tolist())
    assert centroids == [[0.0, 1.0], [10.0, 2.0]]
    assert sorted(kmeans.counts.tolist()) == [2.0, 3.0]


def test_kmeans_needs_as_many_inputs_as_experts():
    kmeans = StreamingKMeans(3, torch.Generator().manual_seed(0), spherical=True)
    kmeans.add(0, torch.ones(2, 4))
    with pytest.raises(moespec.MoespecError, match="k-means of 3 centroids needs at least 3 router inputs, the "
                                                   "images gave 2; give more images"):
        kmeans.result("blocks.0.mlp")


@pytest.mark.parametrize("upcycle,images,message", [
    ({"router_init": "hidden"}, None, "hidden points each expert's row along the mean input of its source's images, "
                                      "so one source gives every row the same direction"),
    ({"router_init": "kmeans"}, None, "kmeans needs images: an image folder or batch (--images DIR)"),
])
def test_routers_from_data_need_their_images(upcycle, images, message, dense_checkpoint):
    path, _ = dense_checkpoint(SMALL)
    with pytest.raises(SpecError) as err:
        moespec.upcycle(spec_of(TWO, **upcycle), path, images=images)
    problem, = err.value.problems
    assert problem.path == "upcycle.router_init" and problem.message.startswith(message)


def test_a_batch_of_the_wrong_size_is_refused(dense_checkpoint):
    path, _ = dense_checkpoint(SMALL)
    with pytest.raises(moespec.MoespecError, match=r"images\[0\]: expected a float batch \[B, 3, 32, 32\] at the "
                                                   r"spec's input_size, got torch.float32 \[2, 3, 64, 64\]"):
        moespec.upcycle(spec_of(TWO, router_init="kmeans"), path, images=torch.zeros(2, 3, 64, 64))


def _reinitialized(state: dict, dense: dict, block: int = 0) -> list[torch.Tensor]:
    """Per expert, the hidden units whose fc1 row differs from the dense FFN's."""
    fc1, dense_fc1 = state[f"blocks.{block}.mlp.experts.fc1.weight"], dense[f"blocks.{block}.mlp.fc1.weight"]
    return [torch.nonzero((fc1[e] != dense_fc1).any(dim=1)).flatten() for e in range(fc1.shape[0])]


def test_drop_upcycling_reinitializes_exactly_the_fraction_with_the_dense_statistics(dense_checkpoint):
    """r = 0.25 of 128 hidden units: 32 per expert, a different subset per expert; the fc1 rows, fc1 bias entries
    and fc2 columns of those units, and only those, are redrawn; their values have the mean and std of the dense
    values they replace (32 x 32 = 1,024 draws per fc1: the sample std is within 2.2% of the true one, the mean
    within std / 32, so 10% and 4 std / 32 are 4.5 and 4 standard errors)."""
    path, dense = dense_checkpoint(SMALL)
    dense = dense.state_dict()
    moe = [{"where": {"every": 1}, "experts": 4, "router": {"top_k": 1}}]
    state = moespec.upcycle(spec_of(moe, drop=0.25), path).state_dict()
    units = _reinitialized(state, dense)
    assert [len(u) for u in units] == [32] * 4
    assert len({tuple(u.tolist()) for u in units}) == 4
    for e, chosen in enumerate(units):
        kept = torch.ones(128, dtype=torch.bool)
        kept[chosen] = False
        fc2, dense_fc2 = state["blocks.0.mlp.experts.fc2.weight"][e], dense["blocks.0.mlp.fc2.weight"]
        assert torch.equal(fc2[:, kept], dense_fc2[:, kept]) and (fc2[:, chosen] != dense_fc2[:, chosen]).all()
        bias, dense_bias = state["blocks.0.mlp.experts.fc1.bias"][e], dense["blocks.0.mlp.fc1.bias"]
        assert torch.equal(bias[kept], dense_bias[kept]) and (bias[chosen] != dense_bias[chosen]).all()
        assert torch.equal(state["blocks.0.mlp.experts.fc2.bias"][e], dense["blocks.0.mlp.fc2.bias"])
        new, old = state["blocks.0.mlp.experts.fc1.weight"][e][chosen], dense["blocks.0.mlp.fc1.weight"][chosen]
        assert new.std().item() == pytest.approx(old.std().item(), rel=0.1)
        assert abs(new.mean().item() - old.mean().item()) <= 4 * old.std().item() / 32


def test_drop_one_redraws_every_unit_and_zero_copies(dense_checkpoint):
    path, dense = dense_checkpoint(SMALL)
    moe = [{"where": {"every": 1}, "experts": 2, "router": {"top_k": 1}}]
    state = moespec.upcycle(spec_of(moe, drop=1.0), path).state_dict()
    assert [len(u) for u in _reinitialized(state, dense.state_dict())] == [128, 128]
    plain = moespec.upcycle(spec_of(moe, drop=0.0), path).state_dict()
    assert [len(u) for u in _reinitialized(plain, dense.state_dict())] == [0, 0]
    assert torch.equal(plain["blocks.1.mlp.router.gate.weight"], moespec.upcycle(spec_of(moe), path).state_dict()[
        "blocks.1.mlp.router.gate.weight"])  # r = 0 draws nothing: the router is today's

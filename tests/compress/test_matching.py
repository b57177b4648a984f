"""The Hungarian assignment against brute force, unit matching of permuted experts, and the clustering."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from moespec.compress.matching import assignment, cluster, match_units


def test_assignment_is_the_brute_force_optimum():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 5, 6):
        for _ in range(20):
            cost = rng.normal(size=(n, n)).round(1)  # ties included
            p = assignment(cost)
            best = min(sum(cost[i, q[i]] for i in range(n)) for q in itertools.permutations(range(n)))
            assert sorted(p.tolist()) == list(range(n))
            assert abs(sum(cost[i, p[i]] for i in range(n)) - best) < 1e-9


def test_match_units_undoes_a_permutation():
    torch.manual_seed(0)
    anchor = torch.randn(64, 20)
    shuffle = torch.randperm(64)
    other = anchor[shuffle]
    p = match_units(anchor, other)
    assert torch.equal(other[p], anchor)


def test_cluster_groups_the_closest_items():
    points = torch.tensor([[1.0, 0.0], [0.99, 0.1], [0.0, 1.0], [0.1, 0.99], [-1.0, 0.0]])
    similarity = torch.nn.functional.normalize(points, dim=1) @ torch.nn.functional.normalize(points, dim=1).T
    assert cluster(similarity, 3) == [[0, 1], [2, 3], [4]]
    assert cluster(similarity, 5) == [[0], [1], [2], [3], [4]]
    assert cluster(similarity, 1) == [[0, 1, 2, 3, 4]]


def test_a_gated_experts_halves_move_together():
    """GLU: fc1's rows are [gate; value] halves of H units each; unit h is row h of both halves."""
    from moespec.compress.surgery import permuted, unit_features

    hidden, torch_gen = 16, torch.Generator().manual_seed(0)
    state = {"fc1.weight": torch.randn(2 * hidden, 8, generator=torch_gen),
             "fc1.bias": torch.randn(2 * hidden, generator=torch_gen),
             "fc2.weight": torch.randn(8, hidden, generator=torch_gen), "fc2.bias": torch.randn(8, generator=torch_gen)}
    order = torch.randperm(hidden, generator=torch_gen)
    shuffled = permuted(state, order, hidden)
    assert torch.equal(shuffled["fc1.weight"][hidden:], state["fc1.weight"][hidden:][order])
    assert torch.equal(shuffled["fc2.bias"], state["fc2.bias"])
    back = permuted(shuffled, match_units(unit_features(state, hidden), unit_features(shuffled, hidden)), hidden)
    assert all(torch.equal(back[name], state[name]) for name in state)


def test_cluster_is_average_linkage():
    """Against a direct average-linkage clustering (the mean similarity of every pair across two clusters,
    recomputed from the items at each step) on random similarities."""

    def direct(similarity, groups):
        clusters = [[i] for i in range(similarity.shape[0])]
        while len(clusters) > groups:
            pairs = [(a, b) for a in range(len(clusters)) for b in range(a + 1, len(clusters))]
            a, b = max(pairs, key=lambda p: similarity[clusters[p[0]]][:, clusters[p[1]]].mean().item())
            clusters[a] = sorted(clusters[a] + clusters[b])
            del clusters[b]
        return sorted(clusters)

    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        points = torch.randn(9, 4, generator=generator)
        similarity = points @ points.T
        for groups in (1, 3, 5, 9):
            assert cluster(similarity, groups) == direct(similarity, groups)

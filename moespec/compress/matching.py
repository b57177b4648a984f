"""Weight matching: the permutation of one expert's hidden units that best lines them up with another's, and the
grouping of experts by similarity.

    match_units(anchor, other)   Hungarian assignment on the units' weight vectors (MC-SMoE's alignment,
                                 Li et al. 2024; git re-basin's weight matching, Ainsworth et al. 2023)
    cluster(similarity, groups)  average-linkage agglomerative clustering (HC-SMoE, Chen et al. 2024)

scipy's `linear_sum_assignment` is not a dependency of moespec; `assignment` is the classic O(n^3)
shortest-augmenting-path Hungarian algorithm (Kuhn-Munkres with potentials), its inner loop vectorized in numpy.
"""

from __future__ import annotations

import numpy as np
import torch


def assignment(cost: np.ndarray) -> np.ndarray:
    """The permutation `p` minimizing sum_i cost[i, p[i]] over a square matrix `cost` [n, n] (exact)."""
    cost = np.asarray(cost, dtype=np.float64)
    n = cost.shape[0]
    if cost.shape != (n, n):
        raise ValueError(f"a square cost matrix is needed, got {cost.shape}")
    u, v = np.zeros(n + 1), np.zeros(n + 1)
    row_of = np.zeros(n + 1, dtype=np.int64)  # row_of[j]: the row (1-based) assigned to column j; column 0 is virtual
    way = np.zeros(n + 1, dtype=np.int64)
    for i in range(1, n + 1):
        row_of[0], column = i, 0
        best = np.full(n + 1, np.inf)
        used = np.zeros(n + 1, dtype=bool)
        while True:
            used[column] = True
            row = row_of[column]
            free = ~used[1:]
            reduced = cost[row - 1] - u[row] - v[1:]
            better = free & (reduced < best[1:])
            best[1:][better] = reduced[better]
            way[1:][better] = column
            masked = np.where(free, best[1:], np.inf)
            nearest = int(np.argmin(masked)) + 1
            delta = masked[nearest - 1]
            u[row_of[used]] += delta
            v[used] -= delta
            best[1:][free] -= delta
            column = nearest
            if row_of[column] == 0:
                break
        while column:  # flip the augmenting path
            previous = way[column]
            row_of[column] = row_of[previous]
            column = previous
    permutation = np.empty(n, dtype=np.int64)
    permutation[row_of[1:] - 1] = np.arange(n)
    return permutation


def match_units(anchor: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """The permutation `p` [H] such that `other[p]` lines up with `anchor` unit by unit: maximizes
    sum_h <anchor[h], other[p[h]]>, the weight-matching objective. `anchor`, `other`: [H, D], one row per hidden
    unit (its fc1 rows, fc1 bias, inner-norm entries and fc2 column, concatenated)."""
    similarity = anchor.double() @ other.double().T  # [H, H]
    return torch.from_numpy(assignment(-similarity.cpu().numpy()))


def cluster(similarity: torch.Tensor, groups: int) -> list[list[int]]:
    """Average-linkage agglomerative clustering of E items with pairwise `similarity` [E, E] (higher: closer)
    into `groups` clusters, as HC-SMoE groups experts. Returns the clusters, each sorted, ordered by their
    smallest member (so that merged experts keep the order of the experts they came from)."""
    clusters = [[i] for i in range(similarity.shape[0])]
    similarity = similarity.double()
    while len(clusters) > groups:
        best, pair = -np.inf, (0, 1)
        for a in range(len(clusters)):
            for b in range(a + 1, len(clusters)):
                linkage = similarity[clusters[a]][:, clusters[b]].mean().item()
                if linkage > best:
                    best, pair = linkage, (a, b)
        a, b = pair
        clusters[a] = sorted(clusters[a] + clusters[b])
        del clusters[b]
    return sorted(clusters, key=lambda members: members[0])

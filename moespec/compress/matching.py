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
    into `groups` clusters, as HC-SMoE groups experts: the two clusters of the highest mean pairwise similarity
    merge, until `groups` are left (ties: the first pair in order). The linkage of a merged cluster to another is
    the size-weighted mean of its parts' (Lance-Williams), so a step costs O(E^2). Returns the clusters, each
    sorted, ordered by their smallest member (merged experts keep the order of the experts they came from)."""
    count = similarity.shape[0]
    clusters: list[list[int] | None] = [[i] for i in range(count)]
    linkage = similarity.double().clone()
    alive = torch.ones(count, dtype=torch.bool)
    for _ in range(count - groups):
        masked = linkage.clone()
        masked[~alive] = -np.inf
        masked[:, ~alive] = -np.inf
        masked = masked.triu(diagonal=1) + torch.full_like(masked, -np.inf).tril()  # pairs a < b only
        a, b = divmod(int(masked.argmax()), count)
        size_a, size_b = len(clusters[a]), len(clusters[b])
        merged = (size_a * linkage[a] + size_b * linkage[b]) / (size_a + size_b)
        linkage[a], linkage[:, a] = merged, merged
        clusters[a] = sorted(clusters[a] + clusters[b])
        clusters[b], alive[b] = None, False
    return sorted((members for members in clusters if members is not None), key=lambda members: members[0])

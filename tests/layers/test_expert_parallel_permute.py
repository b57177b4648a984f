"""The rank-major -> expert-major permutation of received rows, as pure tensors (torchtitan's style of unit test):
zero-row segments, nothing received, one rank."""

from __future__ import annotations

import torch

from moespec.layers.steps.transport import expert_major


def _by_hand(counts: list[list[int]]) -> tuple[list[int], list[int]]:
    """Rows are numbered in arrival order (rank s, then local expert e); list them expert by expert."""
    start, segments = 0, {}
    for s, row in enumerate(counts):
        for e, n in enumerate(row):
            segments[s, e] = list(range(start, start + n))
            start += n
    experts = len(counts[0])
    order = [i for e in range(experts) for s in range(len(counts)) for i in segments[s, e]]
    return order, [sum(row[e] for row in counts) for e in range(experts)]


def test_rows_come_out_expert_major_with_per_expert_counts():
    for counts in ([[2, 0, 1], [0, 3, 2]], [[1, 1], [1, 1], [0, 0], [4, 0]], [[0, 5]], [[3, 0, 0, 2]]):
        order, local = expert_major(torch.tensor(counts), sum(map(sum, counts)))
        assert (order.tolist(), local.tolist()) == _by_hand(counts)


def test_nothing_received_is_an_empty_order():
    order, local = expert_major(torch.zeros(4, 2, dtype=torch.long), 0)
    assert order.shape == (0,) and local.tolist() == [0, 0]

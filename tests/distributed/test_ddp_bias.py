"""DeepSeek-V3's balancing bias under DistributedDataParallel: the loads of every rank and every micro-batch move
the bias, as one process that sees them all moves it. DDP broadcasts rank 0's buffers at each forward that
follows a synchronized one, so before moespec listed the counts for DDP to leave alone, a gradient
accumulation without `no_sync()` counted rank 0's first micro-batches on every rank; and `update_bias` without
a group moved each rank's bias by its own loads only."""

import json

import pytest

import moespec

from .ddp_bias_worker import MICRO_BATCHES, SPEC, biases, micro_batch
from .launch import torchrun

WORLD = 2


@pytest.mark.slow
def test_ddp_accumulation_moves_the_bias_by_the_loads_of_every_rank_and_micro_batch(tmp_path):
    torchrun(WORLD, "tests/distributed/ddp_bias_worker.py", tmp_path, timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

    reference = moespec.create_model(moespec.load_spec(SPEC), seed=0)  # one process, no torch.distributed
    for rank in range(WORLD):
        for step in range(MICRO_BATCHES):
            reference(micro_batch(rank, step))
    loads = [m.router.balance.tokens_per_expert.clone() for m in moespec.moe_layers(reference).values()]
    assert moespec.update_bias(reference) == 2
    expected = biases(reference)

    assert all(any(bias != 0 for bias in layer) for layer in expected.values()), "the loads must be uneven"
    assert all(load.sum() == WORLD * MICRO_BATCHES * 4 * 17 for load in loads)  # 16 patches + [CLS] per image
    for result in ranks:
        assert result["updated"] == 2
        assert result["biases"] == expected

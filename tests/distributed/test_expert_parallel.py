"""Expert parallelism gives the numbers of one process: the test matrix of `ep_cases.py`, each case on 2 gloo
ranks (4 ranks in the slow run), in float64 (one case in float32), against one process with the same weights
on the whole batch, with dropout and router noise off."""

from __future__ import annotations

import json

import pytest

from .ep_cases import CASES
from .launch import ROOT, torchrun

pytestmark = pytest.mark.slow  # torchrun in subprocesses (2 ranks: 17 s; 4 ranks): CI runs them

WORKER = ROOT / "tests" / "distributed" / "ep_worker.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{world: [per-rank results]}: one torchrun per world size for every case, run on first use (a failure
    is kept, not retried by every test)."""
    found: dict[tuple[int, bool], list[dict] | AssertionError] = {}

    def get(world: int, on_device_path: bool = False) -> list[dict]:
        key = (world, on_device_path)
        if key not in found:
            out = tmp_path_factory.mktemp(f"ep{world}")
            try:
                torchrun(world, WORKER, out, *(["--device-path"] if on_device_path else []), *CASES)
                found[key] = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]
            except AssertionError as failure:
                found[key] = failure
        if isinstance(found[key], AssertionError):
            raise found[key]
        return found[key]

    return get


def _check(per_rank: list[dict], case: str) -> None:
    tolerance = 1e-5 if case.endswith("fp32") else 1e-10  # float32 / float64
    for rank, result in enumerate(per_rank):
        r = result[case]
        assert r["output_scale"] > 0.1 and r["grad_scale"] > 1e-3, "a trivial model proves nothing"
        assert r["output"] <= tolerance, f"rank {rank}: outputs differ from one process's by {r['output']}"
        assert r["aux"] <= tolerance * max(1.0, r["aux_value"]), f"rank {rank}: aux loss differs by {r['aux']}"
        assert r["replicated_grad"] <= tolerance, f"rank {rank}: replicated gradients differ by {r['replicated_grad']}"
        assert r["expert_grad"] <= tolerance, f"rank {rank}: expert gradients differ by {r['expert_grad']}"
        assert r["stats_equal"], f"rank {rank}: routing_stats {r['stats']} != one process's {r['ref_stats']}"
        assert r["bias"] <= tolerance, f"rank {rank}: the balancing bias differs from one process's by {r['bias']}"
        assert r["bias_moved"], f"rank {rank}: update_bias left a balancing bias unchanged"


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_compute_what_one_process_computes(results, case):
    _check(results(2), case)


@pytest.mark.parametrize("case", list(CASES))
def test_four_ranks_compute_what_one_process_computes(results, case):
    _check(results(4), case)


@pytest.mark.parametrize("case", list(CASES))
def test_one_rank_computes_what_the_unsharded_model_computes(results, case):
    """On a world of one the sharded bank is the whole bank: no exchange, the same numbers."""
    _check(results(1), case)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_on_the_gpu_path_compute_what_one_process_computes(results, case):
    """The sync-free path (`dispatch.device_path()`, what a GPU runs): a capacity's dropped pairs stay after the
    segments (`Routing.dropped`) and are not sent to other ranks."""
    _check(results(2, on_device_path=True), case)


def test_a_rank_receives_no_rows_when_every_item_goes_to_one_expert(results):
    counts = results(2)[0]["one-expert"]["counts"]
    assert all(sum(1 for c in layer if c) == 1 for layer in counts), counts  # one expert takes every item

"""A 2-D mesh of data and expert parallelism computes what one process computes (issue 59): every wrapping of
`mesh_worker.py` on 4 gloo ranks (2 for some) against one process on the whole batch, in float64, and the
save and resume of `mesh_state_worker.py` across meshes. Every run is a torchrun in a subprocess with a
timeout (`launch.py`): a hang fails the test."""

from __future__ import annotations

import json

import pytest
import torch

import moespec
import moespec.distributed as md

from .launch import ROOT, torchrun
from .mesh_state_worker import SPEC, adamw, moments
from .mesh_worker import reference_model

pytestmark = pytest.mark.slow  # torchrun in subprocesses (4 ranks, about 20 s a run): CI runs them

WORKER = ROOT / "tests" / "distributed" / "mesh_worker.py"
STATE_WORKER = ROOT / "tests" / "distributed" / "mesh_state_worker.py"
TOLERANCE = 1e-5  # the bar (float64 reaches 1e-12 here)

EQUAL = [f"parallelize-{data}:{mesh}:{spec}" for data in ("ddp", "fsdp") for mesh in ("2:2", "1:4", "4:1")
         for spec in ("switch", "two-experts", "bias") if (mesh, spec) != ("1:4", "two-experts")]  # E=2 < 4
EQUAL += [f"parallelize-{data}:2:2:{spec}" for data in ("ddp", "fsdp") for spec in ("soft", "expert-choice")]
EQUAL += ["parallelize-fsdp:4:1:soft"]
EQUAL += ["shard-ddp:2:2", "shard-ddp:1:4", "shard-ddp:4:1:two-experts", "shard-ddp:2:2:two-experts",
          "shard-fsdp-ignored:2:2", "shard-fsdp-own-mesh:2:2", "loaded-ddp:2:2", "loaded-fsdp:2:2"]
REFUSED = ["shard-fsdp-plain:2:2", "zero3:2:2", "shard-uneven:2:2", "loaded-elsewhere:2:2"]
TWO_RANKS = ["parallelize-fsdp:1:2:bias", "parallelize-ddp:2:1:bias", "shard-ddp:1:2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{world: rank 0's results, every case in one torchrun} (each rank checks its own slice; rank 0's
    numbers stand for the others, which `test_every_rank_agrees` compares)."""
    found = {}
    for world, cases in ((4, EQUAL + REFUSED), (2, TWO_RANKS)):
        out = tmp_path_factory.mktemp(f"mesh{world}")
        torchrun(world, WORKER, out, *cases)
        found[world] = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]
    return found


@pytest.mark.parametrize("case", EQUAL + TWO_RANKS)
def test_the_mesh_computes_what_one_process_computes(results, case):
    for rank, result in enumerate(results[2 if case in TWO_RANKS else 4]):
        r = result[case]
        assert "error" not in r, f"rank {rank}: {r['error']}"
        assert r["grad_scale"] > 1e-3, "a trivial model proves nothing"
        assert r["loss"] <= TOLERANCE, f"rank {rank}: the loss differs from one process's by {r['loss']}"
        assert r["grads"] <= TOLERANCE, f"rank {rank}: a gradient differs from one process's by {r['grads']}"
        assert r["params"] <= TOLERANCE, f"rank {rank}: a parameter after the step differs by {r['params']}"
        assert r["bias"] <= TOLERANCE, f"rank {rank}: a balancing bias after update_bias differs by {r['bias']}"
        assert r["norms"] <= TOLERANCE, f"rank {rank}: clip_grad_norm_'s 2- or inf-norm differs by {r['norms']}"


@pytest.mark.parametrize("case", REFUSED)
def test_a_wrapping_that_would_be_wrong_is_refused_naming_parallelize(results, case):
    errors = {result[case].get("error") for result in results[4]}
    assert len(errors) == 1 and None not in errors, f"every rank raises the same error: {errors}"
    error = errors.pop()
    assert "parallelize" in error, error
    if case.startswith("shard-fsdp-plain"):
        assert "blocks.0.mlp.experts" in error and "mixes" in error, error
    if case.startswith("zero3"):
        assert "aux losses" in error, error
    if case.startswith("loaded-elsewhere"):
        assert "already sharded over ranks [0, 1, 2, 3], but the mesh's ep rows are [[0, 1], [2, 3]]" in error, error


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A state and a checkpoint saved at (dp, ep) = (2, 2) under FSDP2 after two AdamW steps, and the one
    process's reference."""
    folder = tmp_path_factory.mktemp("saved")
    torchrun(4, STATE_WORKER, "save", folder, 2, 2, "fsdp")
    return folder


@pytest.mark.parametrize("mesh", ["4 1 fsdp", "1 4 fsdp", "2 2 ddp", "4 1 ddp"])
def test_a_state_saved_at_2x2_resumes_on_another_mesh(saved, mesh):
    torchrun(4, STATE_WORKER, "resume", saved, *mesh.split())
    for rank in range(4):
        r = json.loads((saved / f"resume-{mesh.replace(' ', '-')}" / f"rank{rank}.json").read_text())
        assert r["extra"] == {"step": 2} and r["moment_names"], r
        assert r["params"] <= TOLERANCE and r["buffers"] <= TOLERANCE and r["moments"] <= TOLERANCE, (rank, r)


def test_a_state_saved_at_2x2_resumes_in_one_process(saved):
    reference = torch.load(saved / "reference.pt")
    model = reference_model(SPEC)
    with torch.no_grad():  # other weights, so that a load that read nothing fails
        for p in model.parameters():
            p.add_(1.0)
    optimizer = adamw(model)
    assert md.load_state(saved / "state", model, optimizer) == {"step": 2}
    assert max(float((p.detach() - reference["params"][n]).abs().max()) for n, p in model.named_parameters()) \
        <= TOLERANCE
    found = moments(model, optimizer)
    assert sorted(found) == sorted(reference["moments"])
    assert max(float((v - reference["moments"][n][k]).abs().max()) for n, state in found.items()
               for k, v in state.items()) <= TOLERANCE


def test_moespec_save_under_fsdp_at_2x2_writes_the_one_process_checkpoint(saved):
    reference = torch.load(saved / "reference.pt")
    model = moespec.load(saved / "model.safetensors")
    for name, p in model.named_parameters():  # saved from float64, read into the spec's float32
        assert torch.allclose(p.double(), reference["params"][name], atol=TOLERANCE), name
    for name, b in model.named_buffers():
        assert torch.allclose(b.double(), reference["buffers"][name].double(), atol=TOLERANCE), name


@pytest.mark.parametrize("world, mesh", [(4, "2 2 fsdp"), (2, "1 2 ddp")])
def test_a_failed_save_fails_every_rank_promptly_with_one_message(tmp_path, world, mesh):
    torchrun(world, STATE_WORKER, "fail", tmp_path, *mesh.split())
    results = [json.loads((tmp_path / f"fail-{mesh.replace(' ', '-')}" / f"rank{r}.json").read_text())
               for r in range(world)]
    assert len({r["error"] for r in results}) == 1, results
    assert "No space left on device" in results[0]["error"] and "broken.safetensors" in results[0]["error"]
    assert max(r["seconds"] for r in results) < 20, "every rank fails at once, not at the process group's timeout"
    assert not (tmp_path / "broken.safetensors").exists()


def test_a_state_saved_under_ddp_at_2x2_resumes_under_fsdp_at_1x4(tmp_path):
    torchrun(4, STATE_WORKER, "save", tmp_path, 2, 2, "ddp")
    torchrun(4, STATE_WORKER, "resume", tmp_path, 1, 4, "fsdp")
    for rank in range(4):
        r = json.loads((tmp_path / "resume-1-4-fsdp" / f"rank{rank}.json").read_text())
        assert r["params"] <= TOLERANCE and r["buffers"] <= TOLERANCE and r["moments"] <= TOLERANCE, (rank, r)

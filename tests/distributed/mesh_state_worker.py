"""One rank of the 2-D mesh's save and resume checks; run under torchrun by tests/distributed/test_mesh.py.

    torchrun --nproc_per_node 4 tests/distributed/mesh_state_worker.py save   DIR DP EP DATA
    torchrun --nproc_per_node 4 tests/distributed/mesh_state_worker.py resume DIR DP EP DATA
    torchrun --nproc_per_node 2 tests/distributed/mesh_state_worker.py fail   DIR DP EP DATA

save: one process's model (the reference) and a copy laid out by `parallelize` train two AdamW steps with
clipping on the global batch (the copy on this rank's slice); the copy saves DIR/state (`save_state`) and
DIR/model.safetensors (`moespec.save`); rank 0 saves the reference's parameters and AdamW moments by name to
DIR/reference.pt. resume: a freshly initialized model, laid out on this mesh, loads DIR/state; each rank writes
DIR/resume-DP-EP-DATA/rank{r}.json with the largest difference of its parameters and moments from the
reference's. fail: rank 0's write of moespec.save fails after its first tensor; every rank writes the error it
raised and how long it took.
"""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import moespec  # noqa: E402
import moespec.distributed as md  # noqa: E402
import moespec.weights.checkpoint as checkpoint  # noqa: E402
from moespec import MoespecError  # noqa: E402
from tests.distributed.mesh_worker import BATCH, reference_model  # noqa: E402

SPEC = "bias"  # sigmoid top-2 with a balancing bias (a buffer) and a z-loss


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + step)
    return (torch.randn(BATCH, 3, 32, 32, generator=generator, dtype=torch.float64),
            torch.randint(0, 10, (BATCH,), generator=generator))


def adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05)


def train(model, named, optimizer, mine: slice, clip) -> None:
    for step in range(2):
        x, y = batch(step)
        loss = F.cross_entropy(model(x[mine]), y[mine]) + moespec.aux_loss(named)
        loss.backward()
        clip(model, 0.5)
        optimizer.step()
        optimizer.zero_grad()
        moespec.update_bias(named)


def moments(named, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    by_param = {id(p): n for n, p in named.named_parameters()}
    return {by_param[id(p)]: {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim()}
            for p, state in optimizer.state.items()}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def laid_out(mesh_dims: tuple[int, int], data: str, fresh: bool):
    mesh = init_device_mesh("cpu", mesh_dims, mesh_dim_names=("dp", "ep"))
    model = reference_model(SPEC)
    if fresh:  # other weights, so that a resume that read nothing fails
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    named = copy.deepcopy(model)
    return md.parallelize(named, mesh, data=data), named


def save(folder: Path, dims: tuple[int, int], data: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = reference_model(SPEC)
    trained, named = laid_out(dims, data, fresh=False)
    ref_optimizer, optimizer = adamw(reference), adamw(trained)
    train(reference, reference, ref_optimizer, slice(None), lambda m, n: torch.nn.utils.clip_grad_norm_(
        m.parameters(), n))
    per = BATCH // world
    train(trained, named, optimizer, slice(rank * per, (rank + 1) * per), md.clip_grad_norm_)
    md.save_state(folder / "state", trained, optimizer, extra={"step": 2})
    moespec.save(trained, folder / "model.safetensors")
    if rank == 0:
        torch.save({"params": {n: p.detach() for n, p in reference.named_parameters()},
                    "buffers": dict(reference.named_buffers()), "moments": moments(reference, ref_optimizer)},
                   folder / "reference.pt")
    dist.barrier()


def resume(folder: Path, dims: tuple[int, int], data: str) -> dict:
    trained, named = laid_out(dims, data, fresh=True)
    optimizer = adamw(trained)
    extra = md.load_state(folder / "state", trained, optimizer)
    reference = torch.load(folder / "reference.pt")
    banks = {f"{path}.": bank for path, bank in md.expert_banks(named).items()}

    def expected(name: str, whole: torch.Tensor) -> torch.Tensor:
        bank = next((b for prefix, b in banks.items() if name.startswith(prefix)), None)
        return whole if bank is None else whole[bank.first: bank.first + bank.local_experts]

    params = max(float((full(p.detach()) - expected(n, reference["params"][n])).abs().max())
                 for n, p in named.named_parameters())
    buffers = max(float((full(b) - reference["buffers"][n]).abs().max()) for n, b in named.named_buffers())
    found = moments(named, optimizer)
    moment = max(float((full(v) - expected(n, reference["moments"][n][k])).abs().max())
                 for n, state in found.items() for k, v in state.items())
    return {"extra": extra, "params": params, "buffers": buffers, "moments": moment,
            "moment_names": sorted(found) == sorted(reference["moments"])}


def fail(folder: Path, dims: tuple[int, int], data: str) -> dict:
    trained, _ = laid_out(dims, data, fresh=False)
    if dist.get_rank() == 0:
        def broken(path, infos, tensor, *args, **kwargs):
            tensor(infos[0])
            raise OSError(28, "No space left on device")
        checkpoint.write_sharded = broken
    start = time.monotonic()
    try:
        moespec.save(trained, folder / "broken.safetensors")
        error = None
    except MoespecError as raised:
        error = str(raised)
    return {"error": error, "seconds": time.monotonic() - start}


def main() -> None:
    what, folder, dp, ep, data = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    faulthandler.dump_traceback_later(int(os.environ.get("EP_DUMP_AFTER", "240")), exit=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ.get("EP_TIMEOUT", "60"))))
    torch.use_deterministic_algorithms(True)
    if what == "save":
        save(folder, (dp, ep), data)
    else:
        result = (resume if what == "resume" else fail)(folder, (dp, ep), data)
        out = folder / f"{what}-{dp}-{ep}-{data}"
        out.mkdir(exist_ok=True)
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

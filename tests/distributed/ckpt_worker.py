"""One rank of the expert-parallel checkpoint and error checks; run under torchrun by test_checkpoints.py.

    torchrun --nproc_per_node W tests/distributed/ckpt_worker.py MODE[,MODE...] OUT_DIR

Modes:
    files     moespec.save of a sharded model writes the bytes one process writes (one file and shards);
              md.load gives each rank the slices of the saved weights
    upcycle   md.upcycle equals the slices of one process's moespec.upcycle, noise included
    train     AdamW steps in float64; `train-save` saves the state after step 1 and goes on to steps 2 and 3,
              `train-resume` loads it (at any world size, or in one process without torch.distributed) and
              runs steps 2 and 3: both write the global losses of steps 2 and 3
    inspect   inspect_routing of a sharded model reports what one process reports (global counts)
    errors    calling shard_experts twice, different specs on different ranks, md.load of E % W != 0
Each rank writes OUT_DIR/MODE-w{W}-rank{r}.json.
"""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel

import moespec
import moespec.distributed as md
from moespec.errors import MoespecError
from moespec.layers import set_expert_step
from tests.distributed.ep_cases import VIT

INPUT = [3, 32, 32]
MOE = [{"where": {"every": 1}, "experts": 4, "top_k": 2}]


def spec(moe=MOE, **extra) -> moespec.Spec:
    return moespec.load_spec({"name": "ep", "backbone": VIT, "input_size": INPUT, "moe": moe, **extra})


def files(out: Path, rank: int, world: int) -> dict:
    model = moespec.create_model(spec(), seed=0)
    reference = copy.deepcopy(model)
    if rank == 0:
        moespec.save(reference, out / "one.safetensors")
        moespec.save(reference, out / "one-shards" / "model.safetensors", max_shard_size=100_000)
    md.shard_experts(model)
    moespec.save(model, out / "ep.safetensors")
    moespec.save(model, out / "ep-shards" / "model.safetensors", max_shard_size=100_000)
    dist.barrier()
    loaded = md.load(out / "one.safetensors")
    expected = reference.state_dict()
    worst = 0.0
    for name, tensor in loaded.state_dict().items():
        bank = next((b for p, b in md.expert_banks(loaded).items() if name.startswith(p + ".")), None)
        want = expected[name][bank.first: bank.first + bank.local_experts] if bank is not None else expected[name]
        worst = max(worst, (tensor - want).abs().max().item() if tensor.numel() else 0.0)
    x = torch.randn(2, *INPUT, generator=torch.Generator().manual_seed(rank))
    # Bit-equal outputs need the same kernels on both sides. The default step may differ between them (it
    # depends on the rows and experts a bank holds), and the loop and grouped_mm steps send a one-row segment
    # through BLAS's matrix-vector kernel, which rounds differently; padded runs every segment as a matrix.
    set_expert_step(loaded, "padded")
    set_expert_step(reference, "padded")
    output_diff = (loaded.eval()(x) - reference.eval()(x)).abs().max().item()
    return {"load_diff": worst, "output_diff": output_diff}


def upcycle(out: Path, rank: int, world: int) -> dict:
    dense = out / "dense.safetensors"
    if rank == 0:
        torch.manual_seed(5)
        save_file(timm.create_model(VIT["model"], **VIT["kwargs"]).state_dict(), str(dense))
    dist.barrier()
    noisy = spec(upcycle={"noise": 0.01})
    reference = moespec.upcycle(noisy, dense, seed=3).state_dict()
    model = md.upcycle(noisy, dense, seed=3)
    worst = 0.0
    banks = md.expert_banks(model)
    for name, tensor in model.state_dict().items():
        bank = next((b for p, b in banks.items() if name.startswith(p + ".")), None)
        want = reference[name][bank.first: bank.first + bank.local_experts] if bank is not None else reference[name]
        worst = max(worst, (tensor - want).abs().max().item())
    fresh = md.upcycle(spec(), seed=4)  # no checkpoint: the dense model's fresh init is seeded alike
    fresh_reference = moespec.upcycle(spec(), seed=4).state_dict()
    fresh_worst = max((t - fresh_reference[n][md.expert_banks(fresh)[n.rsplit(".experts.", 1)[0] + ".experts"].first
                                               :][: t.shape[0]] if ".experts." in n else t - fresh_reference[n])
                      .abs().max().item() for n, t in fresh.state_dict().items())
    return {"weights_diff": worst, "fresh_diff": fresh_worst}


def inspect(out: Path, rank: int, world: int) -> dict:
    """inspect_routing of a sharded model, each rank routing its share of the batches (5 batches: one rank
    has one batch fewer), equals one process's report."""
    from PIL import Image

    from moespec.apps.inspection import find_images, inspect_routing

    images = out / "images"
    if rank == 0:
        generator = torch.Generator().manual_seed(0)
        for label in ("cat", "dog", "emu"):
            (images / label).mkdir(parents=True, exist_ok=True)
            for i in range(3):
                pixels = (torch.rand(32, 32, 3, generator=generator) * 255).to(torch.uint8).numpy()
                Image.fromarray(pixels).save(images / label / f"{i}.png")
    dist.barrier()
    folder = find_images(images)
    model = moespec.create_model(spec(), seed=0)
    reference = inspect_routing(copy.deepcopy(model), folder, batch_size=2).to_dict()
    md.shard_experts(model)
    report = inspect_routing(model, folder, batch_size=2).to_dict()
    same = json.dumps(report, sort_keys=True) == json.dumps(reference, sort_keys=True)
    return {"same": same, "report": report["layers"][0]["load"], "reference": reference["layers"][0]["load"]}


def _batch(world: int):
    generator = torch.Generator().manual_seed(11)
    return (torch.randn(4, *INPUT, generator=generator, dtype=torch.float64),
            torch.randint(0, 10, (4,), generator=generator))


def _step(model, optimizer, x, y, distributed: bool) -> float:
    """One AdamW step on this rank's slice of the global batch; returns the global loss (mean over ranks)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    per = x.shape[0] // world
    mine = slice(rank * per, (rank + 1) * per)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x[mine]), y[mine]) + moespec.aux_loss(model)
    loss.backward()
    optimizer.step()
    total = loss.detach().clone()
    if distributed:
        dist.all_reduce(total)
    return (total / world).item()


def train(out: Path, mode: str, distributed: bool) -> dict:
    model = moespec.create_model(spec(), seed=0).double()
    if distributed:
        md.shard_experts(model)
        wrapped = DistributedDataParallel(model)
    else:
        wrapped = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    x, y = _batch(0)
    state = out / "state"
    extra = None
    if mode == "train-save":
        first = _step(wrapped, optimizer, x, y, distributed)
        md.save_state(state, model, optimizer, extra={"step": 1, "loss": first})
    else:
        extra = md.load_state(state, model, optimizer)
    # step 2's loss checks the restored weights, step 3's the restored AdamW moments
    losses = [_step(wrapped, optimizer, x, y, distributed) for _ in range(2)]
    return {"losses": losses, "extra": extra}


def errors(out: Path, rank: int, world: int) -> dict:
    found = {}
    model = moespec.create_model(spec(), seed=0)
    md.shard_experts(model)
    try:
        md.shard_experts(model)
    except MoespecError as error:
        found["twice"] = str(error)
    mine = spec([{**MOE[0], "experts": 4 if rank == 0 else 8}])  # rank 1 built another spec
    try:
        md.shard_experts(moespec.create_model(mine, seed=0))
    except MoespecError as error:
        found["mismatch"] = str(error)
    odd = moespec.create_model(spec([{**MOE[0], "experts": 3}]), seed=0)
    if rank == 0:
        moespec.save(odd, out / "odd.safetensors")
    dist.barrier()
    try:
        md.load(out / "odd.safetensors")
    except MoespecError as error:
        found["uneven"] = str(error)
    return found


def main() -> None:
    modes, out = sys.argv[1].split(","), Path(sys.argv[2])
    faulthandler.dump_traceback_later(int(os.environ.get("EP_DUMP_AFTER", "240")), exit=True)  # a hang shows where
    distributed = "WORLD_SIZE" in os.environ
    rank, world = 0, 1
    if distributed:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        rank, world = dist.get_rank(), dist.get_world_size()
    for mode in modes:
        if mode in ("train-save", "train-resume"):
            result = train(out, mode, distributed)
        else:
            result = {"files": files, "upcycle": upcycle, "errors": errors, "inspect": inspect}[mode](out, rank, world)
        (out / f"{mode}-w{world}-rank{rank}.json").write_text(json.dumps(result, indent=1))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

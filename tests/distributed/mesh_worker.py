"""One rank of the 2-D mesh checks; run under torchrun (4 gloo ranks) by tests/distributed/test_mesh.py.

    torchrun --nproc_per_node 4 tests/distributed/mesh_worker.py OUT_DIR CASE [CASE ...]

A case is WRAPPING:DP:EP[:SPEC]. For each, one process's model (the reference) runs the whole global batch of
8 images, one SGD step; a copy laid out by the wrapping runs this rank's slice. Writes OUT_DIR/rank{r}.json
with, per case, the largest differences of the loss, every gradient and every parameter after the step (or
the error the wrapping raised).

    parallelize-ddp, parallelize-fsdp   moespec.distributed.parallelize(model, mesh, data=...)
    shard-ddp                           shard_experts(model, group=mesh["ep"]) + DistributedDataParallel
    shard-fsdp-ignored                  shard_experts, then fully_shard per block and root, experts ignored
    shard-fsdp-own-mesh                 shard_experts, then fully_shard of each bank over mesh["dp"] (torchtitan)
    shard-fsdp-plain                    shard_experts, then a plain fully_shard per block and root
    shard-uneven                        shard_experts over groups of 3 and 1 ranks
    loaded-ddp, loaded-fsdp             shard_experts over mesh["ep"] (as distributed.load does), then parallelize
    loaded-elsewhere                    shard_experts over every rank, then parallelize on a (2, 2) mesh
    zero3                               fully_shard per block and root of the unsharded model
"""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import moespec  # noqa: E402
import moespec.distributed as md  # noqa: E402
from moespec.distributed.parallel import blocks  # noqa: E402
from tests.conftest import randomize  # noqa: E402
from tests.distributed.ep_cases import VIT  # noqa: E402

BATCH = 8  # images in the global batch
SPECS = {
    "switch": [{"where": {"every": 1}, "experts": 4, "top_k": 2, "aux_loss": {"kind": "switch"}}],
    "two-experts": [{"where": {"every": 1}, "experts": 2, "top_k": 1, "aux_loss": {"kind": "importance_load"}}],
    "bias": [{"where": {"every": 1}, "experts": 4, "aux_loss": {"kind": "z_loss"}, "router": {
        "kind": "topk", "top_k": 2, "score": "sigmoid", "bias_balance": {"rate": 0.01}}}],
    "soft": [{"where": {"every": 1}, "experts": 4, "router": {"kind": "soft", "slots_per_expert": 2}}],
    "expert-choice": [{"where": {"every": 1}, "experts": 4, "shared_experts": 1,
                       "router": {"kind": "expert_choice", "capacity": 1.0}}],
}


def reference_model(spec_name: str):
    spec = moespec.load_spec({"name": spec_name, "backbone": VIT, "input_size": [3, 32, 32], "moe": SPECS[spec_name]})
    model = randomize(moespec.create_model(spec, seed=0)).double()
    for layer in moespec.moe_layers(model).values():  # a balancing bias that changes the choices
        balance = getattr(getattr(layer, "router", None), "balance", None)
        if balance is not None:
            balance.expert_bias.copy_(torch.randn(layer.num_experts, generator=torch.Generator().manual_seed(2)))
    return model


def wrap(model, wrapping: str, mesh):
    """(the model to train, the module whose named parameters are the reference's)."""
    dp, ep = mesh["dp"], mesh["ep"]
    if wrapping.startswith("parallelize-"):
        out = md.parallelize(model, mesh, data=wrapping.split("-")[1])
        return out, model
    if wrapping.startswith("loaded-"):  # experts sharded first, as moespec.distributed.load(group=...) does
        md.shard_experts(model, group=ep.get_group() if wrapping != "loaded-elsewhere" else None)
        return md.parallelize(model, mesh, data="fsdp" if wrapping == "loaded-fsdp" else "ddp"), model
    if wrapping == "zero3":
        for block in blocks(model):
            fully_shard(block)
        fully_shard(model)
        return model, model
    if wrapping == "shard-uneven":  # ranks 0-2 in one group, rank 3 alone: refused on every rank
        groups = [dist.new_group([0, 1, 2]), dist.new_group([3])]
        md.shard_experts(model, group=groups[dist.get_rank() == 3])
    md.shard_experts(model, group=ep.get_group())
    if wrapping == "shard-ddp":
        return DistributedDataParallel(model), model
    experts = {p for bank in md.expert_banks(model).values() for p in bank.parameters()}
    if wrapping == "shard-fsdp-own-mesh":
        for bank in md.expert_banks(model).values():
            fully_shard(bank, mesh=dp)
            for name in ("combine", "batched"):
                register_fsdp_forward_method(bank, name)
    ignored = experts if wrapping == "shard-fsdp-ignored" else None
    for block in blocks(model):
        fully_shard(block, ignored_params=ignored)
    fully_shard(model, ignored_params=ignored)
    return model, model


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_case(case: str, rank: int, world: int) -> dict:
    wrapping, dp, ep, *rest = case.split(":")
    spec_name = rest[0] if rest else "switch"
    mesh = init_device_mesh("cpu", (int(dp), int(ep)), mesh_dim_names=("dp", "ep"))
    reference = reference_model(spec_name)
    model = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, 32, 32, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 10, (BATCH,), generator=generator)
    per = BATCH // world
    mine = slice(rank * per, (rank + 1) * per)

    ref_loss = F.cross_entropy(reference(x), y) + moespec.aux_loss(reference)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    moespec.update_bias(reference)

    try:
        trained, named = wrap(model, wrapping, mesh)
        loss = F.cross_entropy(trained(x[mine]), y[mine]) + moespec.aux_loss(named)
        loss.backward()
    except moespec.MoespecError as error:
        return {"error": str(error)}
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    banks = {f"{path}.": bank for path, bank in md.expert_banks(named).items()}

    def expected(name: str, whole: torch.Tensor) -> torch.Tensor:
        bank = next((b for prefix, b in banks.items() if name.startswith(prefix)), None)
        return whole if bank is None else whole[bank.first: bank.first + bank.local_experts]

    grads = max(float((full(p.grad) - expected(n, ref_grads[n])).abs().max()) for n, p in named.named_parameters())
    norms = max(abs(float(md.clip_grad_norm_(trained, 1e9, norm)) -  # a bound that clips nothing: the norm
                    float(torch.linalg.vector_norm(torch.stack([g.norm(norm) for g in ref_grads.values()]), norm)))
                for norm in (2.0, float("inf")))
    torch.optim.SGD(trained.parameters(), lr=0.5).step()
    moespec.update_bias(named)
    ref_params = dict(reference.named_parameters())
    params = max(float((full(p.detach()) - expected(n, ref_params[n].detach())).abs().max())
                 for n, p in named.named_parameters())
    ref_buffers = dict(reference.named_buffers())
    bias = max((float((full(b) - ref_buffers[n]).abs().max()) for n, b in named.named_buffers()
                if n.endswith("expert_bias")), default=0.0)
    return {"loss": abs(float(mean_loss) - float(ref_loss)), "loss_value": float(ref_loss), "grads": grads,
            "grad_scale": max(float(g.abs().max()) for g in ref_grads.values()), "params": params, "bias": bias,
            "norms": norms}


def main() -> None:
    out_dir, cases = Path(sys.argv[1]), sys.argv[2:]
    faulthandler.dump_traceback_later(int(os.environ.get("EP_DUMP_AFTER", "240")), exit=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ.get("EP_TIMEOUT", "60"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    results = {case: run_case(case, rank, world) for case in cases}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

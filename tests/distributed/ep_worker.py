"""One rank of the expert-parallel equality check; run under torchrun by tests/distributed/test_expert_parallel.py.

    torchrun --nproc_per_node W tests/distributed/ep_worker.py OUT_DIR CASE [CASE ...]

For each case: one process's model (the reference) runs the whole global batch; a copy with its experts
sharded and wrapped in DistributedDataParallel runs this rank's slice. Writes OUT_DIR/rank{r}.json with, per
case, the largest differences of outputs, aux loss, replicated and expert gradients, and the routing stats.
"""

from __future__ import annotations

import contextlib
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
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.distributed.ep_cases

import moespec  # noqa: E402
import moespec.distributed as md  # noqa: E402
from moespec.layers import device_path  # noqa: E402
from tests.conftest import randomize  # noqa: E402
from tests.distributed.ep_cases import CASES, input_size  # noqa: E402

PER_RANK = 2  # images per rank


def run_case(name: str, rank: int, world: int) -> dict:
    backbone, moe = CASES[name]
    size = input_size(backbone)
    spec = moespec.load_spec({"name": name, "backbone": backbone, "input_size": size, "moe": moe})
    dtype = torch.float32 if name.endswith("fp32") else torch.float64
    reference = randomize(moespec.create_model(spec, seed=0)).to(dtype)  # no branch scaled to nothing (GRN)
    if name == "one-expert":
        with torch.no_grad():
            for layer in moespec.moe_layers(reference).values():
                layer.router.gate.weight.zero_()
    for layer in moespec.moe_layers(reference).values():  # a balancing bias that changes the choices
        if getattr(getattr(layer, "router", None), "balance", None) is not None:
            bias = torch.randn(layer.num_experts, generator=torch.Generator().manual_seed(2))
            layer.router.balance.expert_bias.copy_(bias)
    for layer in moespec.moe_layers(reference).values():  # clamp bounds that bite (a fresh bank's are infinite)
        if layer.experts.clamp is not None:
            layer.experts.clamp.copy_(torch.tensor([[-1.0, 1.2, -0.05, 0.04], [-1.5, 0.8, -0.04, 0.05],
                                                    [-0.2, 0.3, -0.01, 0.02]]))
    model = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(world * PER_RANK, *size, generator=generator, dtype=dtype)
    y = torch.randint(0, 10, (world * PER_RANK,), generator=generator)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

    ref_out = reference(x)
    ref_aux = moespec.aux_loss(reference)
    (F.cross_entropy(ref_out, y) + ref_aux).backward()
    ref_stats = [layer.routing_stats() for layer in moespec.moe_layers(reference).values()]

    md.shard_experts(model)
    ddp = DistributedDataParallel(model)
    out = ddp(x[mine])
    aux = moespec.aux_loss(model)
    (F.cross_entropy(out, y[mine]) + aux).backward()
    stats = [layer.routing_stats() for layer in moespec.moe_layers(model).values()]

    biases = {path: layer.router.balance.expert_bias.clone() for path, layer in moespec.moe_layers(reference).items()
              if getattr(getattr(layer, "router", None), "balance", None) is not None}
    moespec.update_bias(reference)
    moespec.update_bias(model)  # the loads of every rank's slice: the whole batch's
    reference_layers = moespec.moe_layers(reference)
    bias = max((float((layer.router.balance.expert_bias - reference_layers[path].router.balance.expert_bias).abs()
                      .max()) for path, layer in moespec.moe_layers(model).items() if path in biases), default=0.0)
    bias_moved = all(not torch.equal(reference_layers[path].router.balance.expert_bias, before)
                     for path, before in biases.items())

    ref_params = dict(reference.named_parameters())
    banks = {f"{path}.experts": layer.experts for path, layer in moespec.moe_layers(model).items()}
    replicated, experts = 0.0, 0.0
    for pname, param in model.named_parameters():
        bank = next((b for prefix, b in banks.items() if pname.startswith(prefix + ".")), None)
        expected = ref_params[pname].grad
        if bank is not None:
            expected = expected[bank.first: bank.first + bank.local_experts]
            experts = max(experts, (param.grad - expected).abs().max().item())
        else:
            replicated = max(replicated, (param.grad - expected).abs().max().item())
    counts = [s["tokens_per_expert"] for s in stats]
    return {
        "output": (out - ref_out[mine]).abs().max().item(),
        "output_scale": ref_out[mine].abs().max().item(),
        "grad_scale": max(p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None),
        "aux": abs(aux.item() - ref_aux.item()),
        "aux_value": ref_aux.item(),
        "replicated_grad": replicated,
        "expert_grad": experts,
        "stats_equal": counts == [s["tokens_per_expert"] for s in ref_stats] and all(
            abs(a["drop_fraction"] - b["drop_fraction"]) < 1e-12 and abs(a["mean_top1_gate"] - b["mean_top1_gate"])
            < 1e-6 for a, b in zip(stats, ref_stats, strict=True)),
        "bias": bias,
        "bias_moved": bias_moved,
        "counts": counts,
        "stats": stats, "ref_stats": ref_stats,
    }


def main() -> None:
    out_dir, names = Path(sys.argv[1]), sys.argv[2:]
    on_device_path = names[:1] == ["--device-path"]  # the GPU's sync-free path, run on CPU (both models)
    names = names[1:] if on_device_path else names
    faulthandler.dump_traceback_later(int(os.environ.get("EP_DUMP_AFTER", "240")), exit=True)  # a hang shows where
    dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ.get("EP_TIMEOUT", "60"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    results = {}
    for name in names:
        try:
            with device_path() if on_device_path else contextlib.nullcontext():
                results[name] = run_case(name, rank, world)
        except Exception as error:  # reported per case; the other cases still run
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            raise  # the other ranks may be inside a collective: stop all of them (torchrun does)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

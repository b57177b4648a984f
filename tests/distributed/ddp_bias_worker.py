"""One rank of the balancing-bias check under DistributedDataParallel; run under torchrun by test_ddp_bias.py.

    torchrun --nproc_per_node W tests/distributed/ddp_bias_worker.py OUT_DIR

Each rank trains a tiny ViT whose routers have `bias_balance` under DDP (gloo), accumulating the gradients of
MICRO_BATCHES micro-batches without `no_sync()`, then calls `moespec.update_bias(model)` with no group, and
writes OUT_DIR/rank{r}.json: every layer's bias. The test compares them with one process that sees all the
ranks' micro-batches.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import moespec

SPEC = {"backbone": {"model": "vit_small_patch16_224",
                     "kwargs": {"depth": 2, "img_size": 32, "patch_size": 8, "embed_dim": 48, "num_heads": 2,
                                "num_classes": 10}},
        "input_size": [3, 32, 32],
        "moe": [{"where": {"every": 1}, "experts": 4,
                 "router": {"kind": "topk", "top_k": 1, "bias_balance": {"rate": 0.125}}, "aux_loss": []}]}
MICRO_BATCHES = 3


def micro_batch(rank: int, step: int) -> torch.Tensor:
    """Rank `rank`'s micro-batch `step`: images that differ from rank to rank, so that the loads do too."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 3, 32, 32, generator=generator) * (1 + rank)


def biases(model: torch.nn.Module) -> dict[str, list[float]]:
    return {name: buffer.tolist() for name, buffer in model.named_buffers() if name.endswith("expert_bias")}


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    model = moespec.create_model(moespec.load_spec(SPEC), seed=0)
    ddp = DistributedDataParallel(model)
    for step in range(MICRO_BATCHES):  # gradient accumulation, every backward synchronized
        ddp(micro_batch(rank, step)).sum().backward()
    updated = moespec.update_bias(model)
    (out / f"rank{rank}.json").write_text(json.dumps({"updated": updated, "biases": biases(model)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

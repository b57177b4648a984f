"""Time reading the index of a checkpoint sharded into N one-tensor shards (`checkpoint_files`), at several N:
the reading is linear (an index of 6,000 shards took 11.5 s while it was quadratic, about 2.5 min at 20,000).
A benchmark, not a test: a wall-clock bound fails on a busy machine (tests/io/test_planted_files.py bounds the
work instead, one header read per shard).

    python tools/bench_index.py [N ...]        default: 3000 6000 20000
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from moespec.io import TensorInfo, checkpoint_files, write_safetensors


def seconds_to_read(shards: int) -> float:
    with tempfile.TemporaryDirectory() as folder:
        weight_map = {}
        for i in range(shards):
            name = f"model-{i:05d}-of-{shards:05d}.safetensors"
            write_safetensors(Path(folder) / name, [TensorInfo(f"t{i}", (1,), torch.float32)],
                              lambda info: torch.ones(1), {})
            weight_map[f"t{i}"] = name
        index = Path(folder) / "model.safetensors.index.json"
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        started = time.perf_counter()
        _, files = checkpoint_files(index)
        assert len(files) == shards
        return time.perf_counter() - started


def main(counts: list[int]) -> None:
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
    for shards in counts:
        seconds = seconds_to_read(shards)
        print(f"{shards:>7,} shards: {seconds:7.2f} s ({1e6 * seconds / shards:.0f} us per shard)")


if __name__ == "__main__":
    main([int(n) for n in sys.argv[1:]] or [3000, 6000, 20000])

"""`moespec.distributed.load` reads the spec and the tensors of one write (issue 37): a writer that replaces
the checkpoint between the spec read and the tensor read must not give a model of one write's spec with the
other's weights. Each case runs in a subprocess (a gloo group of one rank, or two) with a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from .ep_cases import VIT
from .launch import ROOT, torchrun

SPECS = {top_k: {"name": f"top{top_k}", "backbone": VIT, "input_size": [3, 32, 32],
                 "moe": [{"where": {"every": 1}, "experts": 2, "top_k": top_k}]} for top_k in (1, 2)}

SWAP = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    import moespec, moespec.distributed as md, moespec.distributed.checkpoint as dc
    path, shard_size, specs = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])

    def filled(top_k):  # top-1 weights are all 1.0, top-2 weights all 2.0: the same shapes
        model = moespec.create_model(moespec.load_spec(specs[str(top_k)]))
        with torch.no_grad():
            for tensor in model.state_dict().values():
                tensor.fill_(float(top_k))
        return model

    old, new = filled(1), filled(2)
    moespec.save(old, path, max_shard_size=shard_size)
    build, swapped = dc.create_model, []

    def create_model(*args, **kwargs):  # the spec is read: another write replaces the checkpoint now
        if not swapped:
            swapped.append(True)
            moespec.save(new, path, force=True, max_shard_size=shard_size)
        return build(*args, **kwargs)

    dc.create_model = create_model
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = md.load(path)
    values = sorted({v for t in model.state_dict().values() for v in t.unique().tolist()})
    print(json.dumps({"top_k": model.moespec_spec.moe[0].router.top_k, "values": values, "swapped": bool(swapped)}))
""")


@pytest.mark.parametrize("shard_size", [pytest.param(10**9, id="one-file"),  # the sharded case: 10 s
                                        pytest.param(20_000, id="sharded", marks=pytest.mark.slow)])
def test_a_write_between_the_spec_read_and_the_tensor_read_is_not_mixed_in(tmp_path, shard_size):
    """The checkpoint is replaced (top-1 -> top-2) right after load has read the spec: the model is the write
    whose spec it was read with, weights included."""
    done = subprocess.run([sys.executable, "-c", SWAP, str(tmp_path / "m.safetensors"), str(shard_size),
                           json.dumps(SPECS)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["swapped"]
    assert result["values"] == [float(result["top_k"])], result


RANKS = textwrap.dedent("""
    import json, os, sys, time, torch, torch.distributed as dist
    import moespec, moespec.distributed as md, moespec.io.sharding as sharding
    path, out, specs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def filled(top_k):
        model = moespec.create_model(moespec.load_spec(specs[str(top_k)]))
        with torch.no_grad():
            for tensor in model.state_dict().values():
                tensor.fill_(float(top_k))
        return model

    if rank == 0:
        moespec.save(filled(1), path)
    new = filled(2)
    dist.barrier()
    opened, real = os.path.join(out, "rank0-opened"), sharding.open_safetensors
    calls = []

    def open_safetensors(file):  # rank 0 opens the old write; then rank 1 replaces it, and opens the new one
        calls.append(file)
        if rank == 1 and len(calls) == 1:
            while not os.path.exists(opened):
                time.sleep(0.01)
            moespec.save(new, path, force=True)
        handle = real(file)
        if rank == 0 and len(calls) == 1:
            open(opened, "w").close()
        return handle

    sharding.open_safetensors = open_safetensors
    try:
        model = md.load(path)
        values = sorted({v for t in model.state_dict().values() for v in t.unique().tolist()})
        result = {"top_k": model.moespec_spec.moe[0].router.top_k, "values": values}
    except moespec.MoespecError as error:
        result = {"error": str(error)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_ranks_that_open_different_writes_read_again_and_agree(tmp_path):
    """On two ranks, rank 0 opens the checkpoint, then a write replaces it, then rank 1 opens it: the ranks
    read one write together (they compare write ids and read again), spec and weights."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    torchrun(2, script, tmp_path / "m.safetensors", tmp_path, json.dumps(SPECS), timeout=240)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert results[0] == results[1] == {"top_k": 2, "values": [2.0]}, results

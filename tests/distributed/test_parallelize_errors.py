"""`parallelize` and `shard_experts` refuse what cannot work with one clear MoespecError, and a (1, 1) mesh
is the model itself (issue 59). One subprocess with a gloo group of one rank, with a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from .launch import ROOT

SCRIPT = textwrap.dedent("""
    import copy, json, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel
    import moespec, moespec.distributed as md
    from tests.distributed.mesh_worker import reference_model

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "ep"))
    found = {}

    def refused(name, call):
        try:
            call()
            found[name] = None
        except moespec.MoespecError as error:
            found[name] = str(error)

    refused("data", lambda: md.parallelize(reference_model("switch"), mesh, data="zero3"))
    refused("names", lambda: md.parallelize(reference_model("switch"),
                                            init_device_mesh("cpu", (1, 1), mesh_dim_names=("data", "expert"))))
    refused("wrapped", lambda: md.parallelize(DistributedDataParallel(reference_model("switch")), mesh))
    refused("sharded", lambda: md.parallelize(md.shard_experts(reference_model("switch")), mesh))  # over ep: taken
    refused("timm", lambda: md.parallelize(torch.nn.Linear(2, 2), mesh))
    reference = reference_model("switch")
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    for data in ("ddp", "fsdp"):
        model = md.parallelize(copy.deepcopy(reference), mesh, data=data)
        found[data] = float((model(x) - reference(x)).abs().max())
    print(json.dumps(found))
""")


def test_parallelize_refuses_what_cannot_work_and_a_mesh_of_one_is_the_model():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert "data='zero3'" in found["data"] and "'ddp', 'fsdp'" in found["data"]
    assert "('data', 'expert')" in found["names"] and "mesh_dim_names=('dp', 'ep')" in found["names"]
    assert "already wrapped" in found["wrapped"]
    assert found["sharded"] is None  # experts sharded over the mesh's ep row, as moespec.distributed.load does
    assert "not built by moespec" in found["timm"]
    assert found["ddp"] == 0.0 and found["fsdp"] == 0.0

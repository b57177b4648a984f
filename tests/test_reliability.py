"""Reliability: nothing half-written when killed, no unpickling by default, corrupt and mismatched
checkpoints refused clearly, bit-identical weights per seed, deterministic eval routing, finite aux losses."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
from argparse import Namespace

import pytest
import torch
import yaml
from safetensors.torch import save_file
from typer.testing import CliRunner

import moespec
from moespec.cli import app
from moespec.errors import CheckpointError, MoespecError
from moespec.io import TensorInfo, atomic_output, read_safetensors_header, write_safetensors, write_sharded
from moespec.layers import MoELayer
from moespec.weights import SPEC_HASH_KEY, SPEC_KEY, read_state_dict

from .conftest import TINY_INPUT, TINY_SPEC_YAML, TINY_VIT, make_spec, write

SPEC = [{"where": {"every": 1}, "experts": 4, "top_k": 2, "router": {"normalize": True}}]


def _state_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.slow
def test_a_killed_write_leaves_no_output_and_the_next_write_removes_its_temp_file(tmp_path):
    target = tmp_path / "model.safetensors"
    writer = textwrap.dedent(f"""
        import sys, time, torch
        from moespec.io import TensorInfo, write_sharded
        infos = [TensorInfo(f"t{{i}}", (1000,), torch.float32) for i in range(5)]
        def tensor(info):
            if info.name == "t2":
                print("writing", flush=True)
                time.sleep(60)  # killed here, half-way through the file
            return torch.ones(1000)
        write_sharded({str(target)!r}, infos, tensor, {{}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    leftovers = sorted(p.name for p in tmp_path.iterdir())  # its temp file, journal and lock file, all hidden
    assert not target.exists() and len(leftovers) == 3 and all(n.startswith(".model.safetensors.") for n in leftovers)
    assert ".model.safetensors.lock" in leftovers
    # no checkpoint is there: the next ordinary write goes ahead and removes what the killed one left (issue 37)
    write_sharded(target, [TensorInfo("t", (1,), torch.float32)], lambda info: torch.ones(1), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_a_live_writers_temp_file_is_left_alone(tmp_path):
    target = tmp_path / "model.safetensors"
    mine = tmp_path / f".model.safetensors.{os.getpid()}.abc.tmp"
    mine.write_bytes(b"in progress")
    with atomic_output(target) as tmp:
        tmp.write_bytes(b"done")
    assert mine.exists()


@pytest.mark.slow
def test_pickles_that_need_code_are_refused_unless_trusted(tmp_path, dense_checkpoint):
    _, dense = dense_checkpoint(TINY_VIT)
    path = tmp_path / "train_state.pth"
    torch.save({"model": dense.state_dict(), "args": Namespace(lr=0.1)}, path)  # as timm's train.py saves
    with pytest.raises(CheckpointError, match="refused to unpickle .*pass --trust-pickle"):
        read_state_dict(path)
    assert set(read_state_dict(path, trust_pickle=True)) == set(dense.state_dict())
    (tmp_path / "spec.yaml").write_text(
        "backbone: {model: vit_small_patch16_224, kwargs: {depth: 2, img_size: 64, num_classes: 10}}\n"
        "input_size: [3, 64, 64]\nmoe: [{where: {every: 1}, experts: 2, top_k: 1}]\n")
    run = subprocess.run([sys.executable, "-m", "moespec.cli", "upcycle", "spec.yaml", "-c", path.name, "-o",
                          "o.safetensors", "--no-check"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 2 and "--trust-pickle" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "o.safetensors").exists()


def _rewrite_header(path, edit):
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + size])
    edit(header)
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + size :])


def test_corrupt_and_foreign_checkpoints_are_refused_clearly(tmp_path):
    path = moespec.save(moespec.create_model(make_spec(TINY_VIT, SPEC)), tmp_path / "moe.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        moespec.load(garbage)
    # weights of one spec under another spec's (correctly hashed) header: the spec decides the model
    other = make_spec(TINY_VIT, [{**SPEC[0], "experts": 3}]).to_yaml()

    def swap_spec(header):
        header["__metadata__"][SPEC_KEY] = other
        header["__metadata__"][SPEC_HASH_KEY] = hashlib.sha256(other.encode()).hexdigest()

    _rewrite_header(path, swap_spec)
    with pytest.raises(CheckpointError, match=r"does not fit the backbone:\n  .*shape mismatches: blocks.0.mlp"):
        moespec.load(path)


def test_same_seed_gives_bit_identical_weights(tmp_path):
    spec = make_spec(TINY_VIT, SPEC)
    hashes = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        hashes.append(_state_hash(moespec.create_model(spec)))
    assert hashes[0] == hashes[1] != hashes[2]
    digests = []
    for seed, name in ((5, "a"), (5, "b"), (6, "c")):  # streamed upcycling from a fresh dense init
        files, _ = moespec.upcycle_to_checkpoint(spec, tmp_path / f"{name}.safetensors", seed=seed, check=False)
        _, start = read_safetensors_header(files[0])  # the weights' bytes; each write has its own write id
        digests.append(hashlib.sha256(files[0].read_bytes()[start:]).hexdigest())
    assert digests[0] == digests[1] != digests[2]


@pytest.mark.parametrize("router", [{"kind": "topk", "noise": True}, {"kind": "expert_choice"},
                                    {"kind": "image"}, {"kind": "soft"}])
def test_eval_routing_is_deterministic(router):
    experts = {"top_k": 1} if router["kind"] == "image" else {}
    group = {"where": {"every": 1}, "experts": 4, **experts, "router": router}
    model = moespec.create_model(make_spec(TINY_VIT, [group]))
    x = torch.randn(2, *TINY_INPUT)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), model(x))


AUX = [{"kind": "importance_load", "weight": 0.01}, {"kind": "switch", "weight": 0.01},
       {"kind": "z_loss", "weight": 0.001}]
ROUTERS = {  # group settings per router kind; every aux loss where the router has one
    "topk": {"top_k": 2, "router": {"kind": "topk"}, "aux_loss": AUX},
    "topk_noise": {"top_k": 2, "router": {"kind": "topk", "noise": True}, "aux_loss": AUX},
    "topk_capacity_bpr": {"top_k": 2, "capacity_factor": 1.0, "router": {"kind": "topk", "bpr": True}, "aux_loss": AUX},
    "topk_drop": {"top_k": 2, "router": {"kind": "topk", "drop_fraction": 0.5}, "aux_loss": AUX},
    "cosine": {"top_k": 2, "router": {"kind": "topk", "gate": {"kind": "cosine"}}, "aux_loss": AUX},
    "l2": {"top_k": 2, "router": {"kind": "topk", "gate": {"kind": "l2"}}, "aux_loss": AUX},
    "expert_choice": {"router": {"kind": "expert_choice"}, "aux_loss": AUX},
    "image": {"top_k": 1, "router": {"kind": "image"}, "aux_loss": AUX},
    "soft": {"router": {"kind": "soft"}},
}


@pytest.mark.parametrize("kind", list(ROUTERS))
def test_aux_losses_stay_finite_when_every_token_picks_one_expert(kind):
    group = {"where": {"every": 1}, "experts": 4, **ROUTERS[kind]}
    model = moespec.create_model(make_spec(TINY_VIT, [group])).train()
    for layer in model.modules():  # every token's logits favour expert 0 by far
        if isinstance(layer, MoELayer) and not hasattr(layer, "phi"):
            gate = layer.router.gate
            original = gate.forward
            gate.forward = lambda x, original=original: original(x) + torch.tensor([30.0, 0, 0, 0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        loss = model(torch.randn(2, *TINY_INPUT)).logsumexp(-1).mean() + moespec.aux_loss(model)
        optimizer.zero_grad()
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            assert all(torch.isfinite(v) for v in layer.aux_losses.values())


def test_outputs_get_the_umasks_permissions_not_the_temp_files(tmp_path):
    umask = os.umask(0o022)
    try:
        with atomic_output(tmp_path / "out.safetensors") as tmp:
            tmp.write_bytes(b"x")
    finally:
        os.umask(umask)
    assert (tmp_path / "out.safetensors").stat().st_mode & 0o777 == 0o644


def test_stats_refuses_a_dense_backbone_too_large_to_build_before_allocating(tmp_path):
    """stats builds the dense backbone on the CPU: 200000-wide blocks (terabytes) are refused, counted on the
    meta device; the other specs still print."""
    wide = TINY_SPEC_YAML.replace("num_classes: 10", "num_classes: 10, embed_dim: 200000, num_heads: 1")
    huge = write(tmp_path, wide, "huge.yaml")
    tiny = write(tmp_path, TINY_SPEC_YAML, "tiny.yaml")
    result = CliRunner().invoke(app, ["stats", str(huge), str(tiny), "--format", "json"])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line]
    errors = [line for line in lines if not line.startswith("moespec: counting: ")]  # piped: a line per spec
    assert lines[0] == "moespec: counting: 1/2 huge.yaml" and lines[2] == "moespec: counting: 2/2 tiny.yaml"
    assert len(errors) == 1 and errors[0].startswith(f"moespec: error: {huge}:2:")
    assert "backbone: its dense backbone vit_small_patch16_224 needs" in errors[0]
    assert "Biggest: blocks.*.mlp.fc1.weight" in errors[0]
    assert [record["spec"] for record in json.loads(result.stdout)] == [str(tiny)]


def test_nan_or_inf_in_timms_pretrained_weights_is_refused(tmp_path, dense_checkpoint):
    """timm's pretrained loader, pointed at a local file (no network), is a source of dense weights like any
    other: a NaN or Inf in it is refused before upcycling."""
    path, dense = dense_checkpoint(TINY_VIT)
    backbone = {**TINY_VIT, "pretrained": True,
                "kwargs": {**TINY_VIT["kwargs"], "pretrained_cfg_overlay": {"file": str(path), "num_classes": 10}}}
    spec = make_spec(backbone, SPEC)
    loaded, source = moespec.weights.dense_model(spec)
    assert source == "timm pretrained vit_small_patch16_224"
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in dense.state_dict().items())
    state = dense.state_dict()
    state["blocks.1.attn.qkv.weight"][0, 0] = float("inf")
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    with pytest.raises(CheckpointError, match=rf"backbone.pretrained: timm's weights for vit_small_patch16_224 "
                                              rf"\({path}\): blocks.1.attn.qkv.weight hold NaN or Inf"):
        moespec.upcycle(spec)


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _one_error_line(result, *needles):
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("moespec: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert all(needle in result.stderr for needle in needles), result.stderr


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(make_spec(TINY_VIT, SPEC).to_yaml())
    return path


@pytest.mark.parametrize("size", ["inf", "nan", "1e400", "-1", "0.5"])
def test_a_shard_size_that_is_no_size_is_a_user_error(spec_file, tmp_path, size):
    for command in ("compile", "upcycle"):
        result = _cli(command, spec_file, "-o", tmp_path / "out.safetensors", "--max-shard-size", size)
        _one_error_line(result, f"--max-shard-size {size!r}: expected a finite, positive size such as 2GB")


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64])
def test_a_seed_out_of_range_is_a_user_error(spec_file, tmp_path, seed):
    for command in ("compile", "upcycle"):
        result = _cli(command, spec_file, "-o", tmp_path / "out.safetensors", "--seed", seed)
        _one_error_line(result, f"--seed {seed}: expected a whole number from 0 to 2**63 - 1 (9223372036854775807)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


def _model_with_spec() -> torch.nn.Module:
    """A model `save` takes, without the cost of building one: any module with a spec attached."""
    model = torch.nn.Linear(2, 2)
    model.moespec_spec = make_spec(TINY_VIT, SPEC)
    return model


def test_an_output_that_is_a_folder_is_refused_even_with_force(spec_file, tmp_path):
    folder = tmp_path / "model.safetensors"
    (folder / "inside").mkdir(parents=True)
    for command in ("compile", "upcycle"):
        for force in ([], ["--force"]):
            result = _cli(command, spec_file, "-o", folder, *force)
            _one_error_line(result, f"{folder} is a folder; the output is a file")
    with pytest.raises(MoespecError, match="is a folder; the output is a file"):
        moespec.save(_model_with_spec(), folder, force=True)
    assert [p.name for p in folder.iterdir()] == ["inside"]


def test_an_output_folder_that_runs_through_a_file_is_a_user_error(spec_file, tmp_path):
    (tmp_path / "blocked").write_text("a file")
    result = _cli("compile", spec_file, "-o", tmp_path / "blocked" / "deeper" / "out.safetensors")
    _one_error_line(result, "cannot create the output's folder", f"{tmp_path / 'blocked'} is a file, not a folder")
    assert (tmp_path / "blocked").read_text() == "a file"


def test_an_unwritable_output_folder_is_a_user_error(spec_file, tmp_path):
    folder = tmp_path / "locked"
    folder.mkdir(mode=0o555)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("chmod 555 does not stop this user's writes (root)")
        result = _cli("compile", spec_file, "-o", folder / "out.safetensors")
    finally:
        folder.chmod(0o755)
    _one_error_line(result, f"{folder}: cannot write files in this folder (Permission denied)")
    assert list(folder.iterdir()) == []


def test_a_full_disk_is_a_user_error_that_keeps_the_old_output(spec_file, tmp_path, monkeypatch):
    old = tmp_path / "out.safetensors"
    infos = [TensorInfo(f"t{i}", (100,), torch.float32) for i in range(2)]
    write_sharded(old, infos, lambda info: torch.ones(100), {}, max_shard_size=400)  # two shards and an index
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    writes, whole = [], [0]

    def full_disk(file, *args):  # the first `whole[0]` files are written whole; the disk is full in the next
        writes.append(file)
        if len(writes) <= whole[0]:
            return write_safetensors(file, *args)
        with open(file, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("moespec.io.writer.write_safetensors", full_disk)
    result = _cli("compile", spec_file, "-o", old, "--force")  # one file over a sharded output
    _one_error_line(result, f"{old}: cannot write it (No space left on device)")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp file, the old output intact
    writes.clear()
    whole[0] = 1
    with pytest.raises(MoespecError, match="cannot write it"):  # shards of other names, the second one cut short
        other = [TensorInfo(f"u{i}", (100,), torch.float32) for i in range(4)]
        write_sharded(old, other, lambda info: torch.zeros(100), {}, max_shard_size=400, force=True)
    assert len(writes) == 2 and {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("step", ["weights", "config", "card"])
def test_a_full_disk_while_a_hub_folder_is_written_is_a_user_error_that_keeps_the_old_folder(
        spec_file, tmp_path, monkeypatch, step):
    """Issue 64, point 2: `--hub --force` over a Hub folder, the disk full at each of its three files: one error
    line, exit 2 (not "internal error: OSError"), and the old folder whole, nothing else left beside it."""
    import moespec.apps.hub_folder as hub_folder

    folder = tmp_path / "hub"
    assert _cli("compile", spec_file, "-o", folder, "--hub", "--seed", 1).exit_code == 0
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if step == "weights":
        monkeypatch.setattr("moespec.io.writer.write_safetensors", full)
    elif step == "config":
        monkeypatch.setattr(hub_folder, "save_config_for_hf", full)
    else:
        real = hub_folder.Path.write_text
        monkeypatch.setattr(hub_folder.Path, "write_text",
                            lambda self, *a, **k: full() if self.name == "README.md" else real(self, *a, **k))
    result = _cli("compile", spec_file, "-o", folder, "--hub", "--force", "--seed", 2)
    _one_error_line(result, str(folder), "No space left on device")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hub", "spec.yaml"]


@pytest.mark.slow
def test_plan_of_a_spec_named_by_one_long_word_takes_linear_time(tmp_path):
    """Issue 64, point 3: a spec whose name is one word of 120,000 letters. rich's repr highlighter was
    quadratic in it (15,000 letters took 4 s, 60,000 took 57 s, so 120,000 would take about 230 s); plain text
    takes about a second. The limit is wide, so that only the quadratic path can reach it."""
    document = make_spec(TINY_VIT, SPEC).model_dump(mode="json", exclude_none=True)
    path = write(tmp_path, yaml.safe_dump({**document, "name": "a" * 120_000}), "long.yaml")
    env = {**os.environ, "MOESPEC_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "moespec.cli", "plan", str(path)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "a" * 1000 in done.stdout

"""`moespec compile` and `moespec upcycle`: outputs, the function-preserving line, and --force."""

from __future__ import annotations

import subprocess
import sys

import pytest

import moespec

pytestmark = pytest.mark.slow  # each test runs moespec in subprocesses (CI runs them; README)

SPEC_YAML = """\
# tiny ViT-S/16 for the CLI tests
backbone:
  model: vit_small_patch16_224
  kwargs: {{depth: 2, img_size: 64, num_classes: 10}}
input_size: [3, 64, 64]
moe:
  - where: {{every: 1}}
    experts: 4
    top_k: 2
    router: {{normalize: {normalize}}}
"""


def _moespec(*args, cwd):
    return subprocess.run([sys.executable, "-m", "moespec.cli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True)


def test_compile_then_upcycle_and_report(tmp_path, dense_checkpoint):
    ckpt, _ = dense_checkpoint({"model": "vit_small_patch16_224",
                                "kwargs": {"depth": 2, "img_size": 64, "num_classes": 10}})
    for normalize in ("true", "false"):
        (tmp_path / f"{normalize}.yaml").write_text(SPEC_YAML.format(normalize=normalize))

    run = _moespec("compile", "true.yaml", "-o", "compiled.safetensors", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "wrote compiled.safetensors (2 MoE layers)" in run.stdout
    assert len(moespec.moe_layers(moespec.load(tmp_path / "compiled.safetensors"))) == 2

    run = _moespec("compile", "true.yaml", "-o", "compiled.safetensors", cwd=tmp_path)
    assert run.returncode == 2 and "already exists; pass --force" in run.stderr and "Traceback" not in run.stderr

    run = _moespec("upcycle", "true.yaml", "--checkpoint", ckpt, "-o", "up.safetensors", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "function-preserving: yes (max |dlogit| = " in run.stdout

    run = _moespec("upcycle", "false.yaml", "--checkpoint", ckpt, "-o", "up2.safetensors", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "function-preserving: no (max |dlogit| = " in run.stdout

    run = _moespec("upcycle", "true.yaml", "--checkpoint", "missing.pth", "-o", "up3.safetensors", cwd=tmp_path)
    assert run.returncode == 2 and "missing.pth: no such checkpoint file" in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".safetensors") == [
        "compiled.safetensors", "dense.safetensors", "up.safetensors", "up2.safetensors"]


def test_upcycle_writes_shards_in_a_precision_and_rejects_bad_sizes(tmp_path, dense_checkpoint):
    ckpt, _ = dense_checkpoint({"model": "vit_small_patch16_224",
                                "kwargs": {"depth": 2, "img_size": 64, "num_classes": 10}})
    (tmp_path / "spec.yaml").write_text(SPEC_YAML.format(normalize="true"))
    (tmp_path / "blocked").write_text("a file where the output folder would go")
    run = _moespec("upcycle", "spec.yaml", "-c", ckpt, "-o", "blocked/model.safetensors", cwd=tmp_path)
    assert run.returncode == 2 and "blocked: cannot create the output's folder" in run.stderr
    assert (tmp_path / "blocked").read_text() == "a file where the output folder would go"
    run = _moespec("upcycle", "spec.yaml", "-c", ckpt, "-o", "out/model.safetensors", "--max-shard-size", "5MB",
                   "--dtype", "bf16", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    # 4 experts x (384x1536 + 1536 + 1536x384 + 384) bf16 ~ 9.4 MB per layer: several 5 MB shards
    shards = sorted(p.name for p in (tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) >= 3
    assert f"wrote out/model.safetensors.index.json ({len(shards)} shards and an index)" in run.stdout
    assert "function-preserving: yes" in run.stdout
    loaded = moespec.load(tmp_path / "out")
    assert len(moespec.moe_layers(loaded)) == 2
    for size in ("2XB", "-1GB", "lots"):
        run = _moespec("upcycle", "spec.yaml", "-o", "x.safetensors", "--max-shard-size", size, cwd=tmp_path)
        assert run.returncode == 2 and f"--max-shard-size {size!r}" in run.stderr and "Traceback" not in run.stderr

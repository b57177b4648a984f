"""Shared fixtures: tiny timm backbones and dense checkpoints that the tests make themselves."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import pytest
import timm
import torch
from hypothesis import HealthCheck, settings
from safetensors.torch import save_file
from timm.layers import ConvMlp
from timm.models import register_model
from torch import nn

import moespec

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"


@pytest.fixture
def no_hang():
    """A read that blocks (on a fifo, say) fails the test after 30 s instead of hanging the suite."""
    def hung(*_):
        raise AssertionError("a read blocked (a fifo waited on?)")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True, scope="session")
def _backbone_cache(tmp_path_factory):
    """The CLI's backbone-sketch cache (`moespec.planning.cache`) goes to a folder of this session's own, for
    the in-process CLI calls and the subprocesses alike: the tests neither read nor fill the user's cache."""
    os.environ["MOESPEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("moespec-cache"))
    yield
    del os.environ["MOESPEC_CACHE_DIR"]

# Hypothesis budgets (tests/spec/test_fuzz_specs.py): "ci" is small, fixed and reproducible; "long" explores.
# Pick one with MOESPEC_FUZZ=long or `pytest --hypothesis-profile=long`. No example database is written.
settings.register_profile("ci", max_examples=100, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=2000, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("MOESPEC_FUZZ", "ci"))

# Small versions of the published backbones: real timm classes, few blocks, small images.
TINY_VIT = {"model": "vit_small_patch16_224", "kwargs": {"depth": 2, "img_size": 64, "num_classes": 10}}
TINY_CONVNEXT = {"model": "convnext_tiny", "kwargs": {"depths": (1, 1, 2, 1), "num_classes": 10}}
TINY_INPUT = [3, 64, 64]


class _ConvMlpBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, padding=1)
        self.mlp = ConvMlp(dim, dim * 3, act_layer=nn.GELU)

    def forward(self, x):
        x = self.conv(x)
        return x + self.mlp(x)


class _ConvMlpNet(nn.Module):
    """A two-stage conv net whose blocks use timm's ConvMlp: exercises the channels-first FFN family."""

    def __init__(self, num_classes: int = 10, dim: int = 16, **kwargs):
        super().__init__()
        self.pretrained_cfg = {"input_size": (3, 32, 32)}
        self.stem = nn.Conv2d(3, dim, 4, stride=4)
        self.stages = nn.Sequential(
            nn.Sequential(_ConvMlpBlock(dim), _ConvMlpBlock(dim)),
            nn.Sequential(nn.Conv2d(dim, dim * 2, 2, stride=2), nn.Sequential(_ConvMlpBlock(dim * 2))),
        )
        self.head = nn.Linear(dim * 2, num_classes)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean(dim=(2, 3)))


@register_model
def moespec_test_convmlp_net(pretrained: bool = False, **kwargs) -> nn.Module:
    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("pretrained_cfg") and k != "cache_dir"}
    return _ConvMlpNet(**kwargs)


FAMILY_WIDTH, FAMILY_HIDDEN = 8, 16


def family_ffn(family: str) -> nn.Module:
    """A small FFN of one of timm's composed families (`moespec/backbones/families.py`)."""
    from timm.models import fastvit, levit, repvit, tiny_vit, vitamin

    width, hidden = FAMILY_WIDTH, FAMILY_HIDDEN
    if family.startswith("Gemma4GatedMlp"):  # timm >= 1.0.30
        clipped = family.endswith("Clipped")  # linears that clamp their input and output: bounds that bite
        ffn = pytest.importorskip("timm.models.gemma4_vit").Gemma4GatedMlp(width, hidden, use_clipped_linears=clipped)
        for i, linear in enumerate((ffn.gate_proj, ffn.up_proj, ffn.down_proj) if clipped else ()):
            for name, value in zip(("input_min", "input_max", "output_min", "output_max"),
                                   (-0.5 - 0.1 * i, 0.6 + 0.1 * i, -0.05 - 0.01 * i, 0.04 + 0.01 * i), strict=True):
                linear.get_buffer(name).fill_(value)
        return ffn
    return {
        "NormMlp": lambda: tiny_vit.NormMlp(width, hidden),  # a shared LayerNorm before fc1
        "GeGluMlp": lambda: vitamin.GeGluMlp(width, hidden),  # a shared LayerNorm, a GLU
        "RepVitMlp": lambda: repvit.RepVitMlp(width, hidden, nn.GELU),  # BatchNorms folded into the experts
        "FastVitConvMlp": lambda: fastvit.ConvMlp(width, hidden),  # a shared depthwise conv + BatchNorm
        "LevitMlp": lambda: levit.LevitMlp(width, hidden),  # Linear + BatchNorm1d pairs, folded
        "SequentialMlp": lambda: nn.Sequential(nn.Conv2d(width, hidden, 1, bias=False), nn.BatchNorm2d(hidden),
                                               nn.ReLU(), nn.Conv2d(hidden, width, 1, bias=False)),
    }[family]()


class _FamilyBlock(nn.Module):
    def __init__(self, family: str):
        super().__init__()
        self.mlp = family_ffn(family)
        self.tokens = not any(isinstance(m, nn.Conv2d) for m in self.mlp.modules())

    def forward(self, x):  # x: [B, C, S, S]
        if not self.tokens:
            return x + self.mlp(x)
        tokens = x.flatten(2).transpose(1, 2)
        return (tokens + self.mlp(tokens)).transpose(1, 2).reshape(x.shape)


class _FamilyNet(nn.Module):
    """Two blocks of one composed FFN family on a stride-8 stem (32 px: a 4 x 4 map), BatchNorm running statistics
    away from (0, 1) so that folding them is exercised."""

    def __init__(self, family: str = "NormMlp", num_classes: int = 10, **kwargs):
        super().__init__()
        self.pretrained_cfg = {"input_size": (3, 32, 32)}
        self.stem = nn.Conv2d(3, FAMILY_WIDTH, 8, stride=8)
        self.blocks = nn.Sequential(_FamilyBlock(family), _FamilyBlock(family))
        self.head = nn.Linear(FAMILY_WIDTH, num_classes)
        generator = torch.Generator().manual_seed(0)
        for m in self.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(0.5 * torch.randn(m.running_mean.shape, generator=generator))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=generator))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


@register_model
def moespec_test_family_net(pretrained: bool = False, **kwargs) -> nn.Module:
    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("pretrained_cfg") and k != "cache_dir"}
    return _FamilyNet(**kwargs)


def family_net(family: str) -> dict:
    """The backbone entry of a spec for `_FamilyNet` of `family`."""
    return {"model": "moespec_test_family_net", "kwargs": {"family": family}}


def quick_first(values, quick, ids=None) -> list:
    """Parametrize values (a tuple for several names) of a long test matrix, named by `ids`: those named in `quick`
    run in the README's test command, the others are marked slow (CI runs the whole matrix)."""
    ids = ids or [str(value) for value in values]
    return [pytest.param(*(value if isinstance(value, tuple) else (value,)), id=name,
                         marks=() if name in quick else pytest.mark.slow)
            for value, name in zip(values, ids, strict=True)]


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def line_of(text: str, needle: str, nth: int = 0) -> int:
    """1-based line number of the `nth` line of `text` containing `needle`."""
    lines = [i + 1 for i, line in enumerate(text.splitlines()) if needle in line]
    assert len(lines) > nth, f"{needle!r} not in the test's YAML"
    return lines[nth]


TINY_SPEC_YAML = """\
# a tiny ViT-S/16: two blocks, 64 px, 4 experts top-2 on both
backbone: {model: vit_small_patch16_224, kwargs: {depth: 2, img_size: 64, num_classes: 10}}
input_size: [3, 64, 64]
moe:
  - where: {every: 1}
    experts: 4
    router: {top_k: 2}
"""
"""The same tiny spec as a file's text, for the CLI tests."""


def make_spec(backbone: dict, moe: list[dict], **extra) -> moespec.Spec:
    return moespec.load_spec({"name": "test", "backbone": backbone, "input_size": TINY_INPUT, "moe": moe, **extra})


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every parameter a non-trivial value (LayerScale gammas and GRN near 1 / 0.1, not 1e-6 / 0), so
    that equivalence tests cannot pass because a branch is scaled to nothing."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p[0].numel()))
            elif name.endswith(("weight", "gamma")):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    return model


@pytest.fixture
def hash_kind():
    """The opt-in hash router (`moespec/routers/hash.py`) registered for one test, and gone after it (the
    built-in language has no `hash`; a registration left behind would change every later test's kinds)."""
    import importlib

    from moespec.spec import register_router_kind, unregister_router_kind

    module = importlib.import_module("moespec.routers.hash")  # importing it registers it, the first time only
    register_router_kind(module.HashRouterSpec)
    yield module
    unregister_router_kind("hash")


@pytest.fixture
def dense_checkpoint(tmp_path):
    """Factory: save a randomized dense timm model as .safetensors; returns (path, model)."""

    def make(backbone: dict, name: str = "dense.safetensors", seed: int = 0):
        model = randomize(timm.create_model(backbone["model"], **backbone.get("kwargs", {})), seed).eval()
        path = tmp_path / name
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
        return path, model

    return make


MEASURED = """\
import resource, subprocess, sys, time
start = time.monotonic()
try:
    done = subprocess.run(sys.argv[2:], capture_output=True, text=True, timeout=float(sys.argv[1]))
    code, out, err = done.returncode, done.stdout, done.stderr
except subprocess.TimeoutExpired as expired:
    code, out, err = "timeout", expired.stdout or b"", expired.stderr or b""
    out, err = (s.decode(errors="replace") if isinstance(s, bytes) else s for s in (out, err))
print(repr((code, out, err, time.monotonic() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)))
"""


def measured_run(argv: list[str], timeout: float, env: dict | None = None) -> tuple:
    """Run `argv` in a subprocess of a subprocess with a timeout: (exit code or "timeout", stdout, stderr,
    seconds, peak RSS in kB of the command alone, from its parent's `getrusage(RUSAGE_CHILDREN)`)."""
    import ast
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", MEASURED, str(timeout), *argv], capture_output=True, text=True,
                          timeout=timeout + 60, env=env)
    assert done.returncode == 0, done.stderr
    return ast.literal_eval(done.stdout)

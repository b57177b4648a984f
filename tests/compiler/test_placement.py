"""Where a model is built (the device it is given, everything on it) and whether it fits there (counted on the
meta device before anything is allocated: dense backbone, experts, gates, Soft MoE slots, shared experts,
rebuilt blocks)."""

from __future__ import annotations

import pytest
import torch

import moespec
from moespec.backbones import placement
from moespec.backbones.placement import tensor_bytes
from moespec.errors import MoespecError, SpecError

from ..conftest import TINY_VIT, make_spec
from .test_sparse_mlp import SMALL as MIXER_SPEC

MOE = [{"where": {"every": 1}, "experts": 4, "top_k": 2}]
TB = 10**12


def _devices(model: torch.nn.Module) -> set[torch.device]:
    return {t.device for t in [*model.parameters(), *model.buffers()]}


def test_meta_puts_every_parameter_and_buffer_on_meta():
    model = moespec.create_model(make_spec(TINY_VIT, MOE), device="meta")
    assert _devices(model) == {torch.device("meta")}


@pytest.mark.parametrize("device", ["bogus", "cuda:x", ""])
def test_an_unknown_device_is_one_clear_error(device):
    with pytest.raises(MoespecError, match=rf"unknown device '{device}'; expected cpu, cuda, cuda:N, meta"):
        moespec.create_model(make_spec(TINY_VIT, MOE), device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(MoespecError, match=r"device 'cuda:1': this machine has no cuda device"):
        moespec.create_model(make_spec(TINY_VIT, MOE), device="cuda:1")


def test_load_builds_on_the_device_it_is_given(tmp_path):
    path = moespec.save(moespec.create_model(make_spec(TINY_VIT, MOE)), tmp_path / "moe.safetensors")
    assert _devices(moespec.load(path, device="meta")) == {torch.device("meta")}
    with pytest.raises(MoespecError, match="unknown device 'bogus'"):
        moespec.load(path, device="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(MoespecError, match=r"device 'cuda': this machine has no cuda device"):
            moespec.load(path, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_builds_and_loads_everything_on_the_gpu(tmp_path):
    spec = make_spec(TINY_VIT, MOE)
    model = moespec.create_model(spec, device="cuda", seed=0)
    assert {d.type for d in _devices(model)} == {"cuda"}
    cpu = moespec.create_model(spec, seed=0)
    path = moespec.save(cpu, tmp_path / "moe.safetensors")
    loaded = moespec.load(path, device="cuda:0")
    assert {d.type for d in _devices(loaded)} == {"cuda"}
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(loaded.eval()(x.cuda()).cpu(), cpu.eval()(x), rtol=1e-4, atol=1e-4)


def test_the_guard_counts_every_tensor_a_build_allocates(monkeypatch):
    """Dense backbone, rebuilt blocks (rescale), MoE experts, shared experts, routers: the model built for real
    holds exactly the bytes counted before; one byte less memory and the build is refused."""
    soft = {**{k: v for k, v in MIXER_SPEC["moe"][1].items() if k != "top_k"}, "router": {"kind": "soft"}}
    spec = moespec.load_spec({**MIXER_SPEC, "moe": [{**MIXER_SPEC["moe"][0], "shared_experts": 1}, soft]})
    needed = sum(tensor_bytes(moespec.create_model(spec)).values())
    monkeypatch.setattr(placement, "device_memory", lambda device: needed / placement.MEMORY_SHARE)
    moespec.create_model(spec)
    monkeypatch.setattr(placement, "device_memory", lambda device: needed / placement.MEMORY_SHARE - 1)
    with pytest.raises(SpecError, match="the model needs"):
        moespec.create_model(spec)


@pytest.mark.parametrize("group, biggest", [
    ({"top_k": 2, "router": {"gate": {"kind": "cosine", "dim": 65536}}}, "blocks.*.mlp.router.gate.proj.weight"),
    ({"router": {"kind": "soft", "slots_per_expert": 65536}}, "blocks.*.mlp.phi"),
    ({"top_k": 2, "shared_experts": 64}, "blocks.*.mlp.shared.fc1.weight"),
], ids=["gate", "soft_slots", "shared"])
def test_what_only_the_moe_layers_allocate_is_refused_before_allocating(tmp_path, monkeypatch, group, biggest):
    """Each case's MoE-only tensors take 2 x 100-400 MB (a 65536-wide gate projection of 384 channels, 4 x 65536
    Soft MoE slots, 64 shared experts of 1536 x 384), more than 80% of a 250 MB machine; the tiny ViT with 4
    experts per layer alone takes about 60 MB."""
    monkeypatch.setattr(placement, "device_memory", lambda device: 250 * 10**6)
    moespec.create_model(make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4}]), device="cpu")  # fits
    path = tmp_path / "big.yaml"
    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4, **group}])
    path.write_text(spec.to_yaml())
    with pytest.raises(SpecError) as refused:  # allocating it would be a RuntimeError, or the OOM killer
        moespec.create_model(moespec.load_spec(path))
    message = str(refused.value)
    assert message.startswith(f"{path}:") and "the model needs" in message and "for its parameters" in message
    assert f"Biggest: {biggest}" in message and "`moespec plan` and `moespec validate` still work" in message

"""`moespec.import_vmoe` against Google's own code: a tiny V-MoE built, run and saved by vmoe in JAX
(tests/data/vmoe/make_reference.py), in vmoe's two index layouts and as an Orbax folder. The golden logits, encoder
tokens and pre_logits are JAX's (reference.npz)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import moespec
from moespec.cli import app
from moespec.errors import MoespecError
from moespec.weights.vmoe import architecture, open_vmoe, vmoe_spec

DATA = Path(__file__).resolve().parent.parent / "data" / "vmoe"
REFERENCE = np.load(DATA / "reference.npz")
CONFIG = json.loads((DATA / "reference.json").read_text())
LAYOUTS = ["vmoe_tiny", "vmoe_tiny_v0", "orbax"]
GROUP_TOKENS = CONFIG["config"]["encoder"]["moe"]["group_size"]  # 2 images of 5 tokens
CAPACITIES = {1.05: "capacity", 2.0: "nodrop", 0.5: "cf050"}
TOLERANCE = 1e-4
IMAGES = torch.from_numpy(REFERENCE["images"].transpose(0, 3, 1, 2).copy())  # NHWC -> NCHW


def _import(layout: str = "vmoe_tiny", capacity_factor: float = 1.05) -> torch.nn.Module:
    return moespec.import_vmoe(DATA / layout, top_k=2, capacity_factor=capacity_factor,
                               group_size=GROUP_TOKENS).eval()


@pytest.fixture(scope="module")
def models() -> dict[float, torch.nn.Module]:
    return {factor: _import(capacity_factor=factor) for factor in CAPACITIES}


def _max_diff(a: torch.Tensor, b: np.ndarray) -> float:
    return float((a - torch.from_numpy(b)).abs().max())


@pytest.mark.parametrize("factor", list(CAPACITIES))
def test_logits_and_tokens_equal_jax(models, factor):
    """The encoder's output tokens as well as the logits: with the MoE in the last block, the logits see only the
    [CLS] token, and a wrong capacity or priority shows only in the other tokens."""
    name = CAPACITIES[factor]
    with torch.no_grad():
        tokens = models[factor].forward_features(IMAGES)
        logits = models[factor].forward_head(tokens)
        assert torch.equal(models[factor](IMAGES), logits)
    assert _max_diff(tokens, REFERENCE[f"encoded_{name}"]) < TOLERANCE
    assert _max_diff(logits, REFERENCE[f"logits_{name}"]) < TOLERANCE


def test_pre_logits_equal_jax(models):
    """flax records the `pre_logits` Dense's output, before the tanh."""
    with torch.no_grad():
        pooled = models[1.05].forward_features(IMAGES)[:, 0]
        dense = models[1.05].fc_norm.fc(pooled)
        assert _max_diff(dense, REFERENCE["pre_logits"]) < TOLERANCE
        assert torch.allclose(models[1.05].forward_head(models[1.05].forward_features(IMAGES), pre_logits=True),
                              torch.tanh(dense))


def test_tokens_are_dropped_at_capacity_half_and_not_at_two(models):
    """ceil(0.5 * 2 * 10 / 4) = 3, rounded up to 4 slots per expert and group: of 20 tokens' 40 choices, some are
    left out; at 2.0 (12 slots) none are. JAX's tokens at 0.5 differ from those with nothing dropped."""
    for factor, dropped in ((0.5, True), (2.0, False), (1.05, False)):
        with torch.no_grad():
            models[factor].forward_features(IMAGES)
        layer = models[factor].blocks[1].mlp
        kept_pairs = sum(layer.routing_stats()["tokens_per_expert"])
        assert (kept_pairs < 2 * IMAGES.shape[0] * 5) == dropped
    assert np.abs(REFERENCE["encoded_cf050"] - REFERENCE["encoded_nodrop"]).max() > 1e-2
    assert models[0.5].blocks[1].mlp.router.capacity(GROUP_TOKENS) == 4


def test_without_vmoe_rounding_the_tokens_differ():
    """The same model with the capacity unrounded (3 slots at 0.5) drops other tokens than vmoe does."""
    model = _import(capacity_factor=0.5)
    model.blocks[1].mlp.router.capacity_multiple = 1
    with torch.no_grad():
        tokens = model.forward_features(IMAGES)
    assert _max_diff(tokens, REFERENCE["encoded_cf050"]) > 1e-2


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_every_layout_gives_the_same_state_dict(models, layout):
    state, other = models[1.05].state_dict(), _import(layout).state_dict()
    assert list(state) == list(other)
    assert all(torch.equal(state[name], other[name]) for name in state)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_reads_every_parameter_of_the_reference(layout):
    arrays = dict(open_vmoe(DATA / layout).tensors())
    params = {name.removeprefix("param:"): REFERENCE[name] for name in REFERENCE.files if name.startswith("param:")}
    assert sorted(arrays) == sorted(params) == sorted(CONFIG["params"])
    assert all(np.array_equal(arrays[name], params[name]) for name in params)


def test_the_architecture_comes_from_the_tree():
    reader = open_vmoe(DATA / "vmoe_tiny.index")
    arch = architecture(reader.shapes(), reader.index)
    config = CONFIG["config"]
    assert (arch.width, arch.depth, arch.heads, arch.mlp, arch.patch) == (
        config["hidden_size"], config["encoder"]["num_layers"], config["encoder"]["num_heads"],
        config["encoder"]["mlp_dim"], tuple(config["patch_size"]))
    assert (arch.moe_blocks, arch.experts, arch.classes, arch.pre_logits, arch.image, arch.tokens) == (
        tuple(config["encoder"]["moe"]["layers"]), config["encoder"]["moe"]["num_experts"], config["num_classes"],
        True, 32, 5)


def test_the_spec_is_vmoes_routing(models):
    spec = models[1.05].moespec_spec
    router = spec.moe[0].router
    assert (router.top_k, router.capacity_factor, router.capacity_multiple, router.group, router.bpr,
            router.noise, router.normalize) == (2, 1.05, 4, 2, False, True, False)
    assert spec.backbone.pre_logits and spec.backbone.kwargs["act_layer"] == "gelu_tanh"
    assert moespec.load_spec(json.loads(json.dumps(spec.model_dump(mode="json")))) == spec


def test_group_size_is_counted_in_tokens_as_vmoe_counts_it():
    reader = open_vmoe(DATA / "vmoe_tiny")
    arch = architecture(reader.shapes(), reader.index)
    assert vmoe_spec(arch, top_k=2, capacity_factor=1.05, group_size=40).moe[0].router.group == 8
    with pytest.raises(MoespecError, match=r"group_size 12: .* an image here is 5 .* give a multiple of 5"):
        vmoe_spec(arch, top_k=2, capacity_factor=1.05, group_size=12)
    with pytest.raises(MoespecError, match=r"capacity_factor 0: give a factor above 0 \(V-MoE: 1.05; from 2 on"):
        vmoe_spec(arch, top_k=2, capacity_factor=0, group_size=10)
    with pytest.raises(MoespecError, match="top_k 5: the checkpoint's MoE layers have 4 experts"):
        vmoe_spec(arch, top_k=5, capacity_factor=1.05, group_size=10)


def test_saved_checkpoint_loads_back_equal(models, tmp_path):
    """`moespec import-vmoe` writes a moespec checkpoint (safetensors, spec inside) that `moespec.load` rebuilds."""
    out = tmp_path / "tiny.safetensors"
    result = CliRunner().invoke(app, ["import-vmoe", str(DATA / "vmoe_tiny"), "-o", str(out), "--group-size",
                                      str(GROUP_TOKENS)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"wrote {out}: V-MoE 32 px, patch 16, width 64, depth 2, 1 MoE layers (blocks "
                                    f"[1]) of 4 experts, top-2, groups of 10 tokens")
    loaded = moespec.load(out).eval()
    assert loaded.moespec_spec.moe == models[1.05].moespec_spec.moe
    assert loaded.moespec_spec.backbone == models[1.05].moespec_spec.backbone
    with torch.no_grad():
        assert _max_diff(loaded.forward_features(IMAGES), REFERENCE["encoded_capacity"]) < TOLERANCE
    again = CliRunner().invoke(app, ["import-vmoe", str(DATA / "vmoe_tiny"), "-o", str(out)])
    assert again.exit_code == 2 and "already exists; pass --force" in again.output


def test_stats_count_the_pre_logits_and_the_rounded_capacity(models):
    """The representation layer is D^2 + D parameters; the executed MACs count vmoe's 4 slots per expert at 0.5."""
    spec = models[0.5].moespec_spec
    plain = spec.model_copy(update={"backbone": spec.backbone.model_copy(update={"pre_logits": False})})
    with_layer, without = moespec.stats(spec), moespec.stats(plain)
    assert with_layer.total_params - without.total_params == 64 * 64 + 64
    router = spec.moe[0].router
    unrounded = spec.model_copy(update={"moe": [spec.moe[0].model_copy(update={
        "router": router.model_copy(update={"capacity_multiple": 1})})]})
    assert with_layer.layers[0].executed_gmacs > moespec.stats(unrounded).layers[0].executed_gmacs


def test_orbax_without_tensorstore_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tensorstore", None)
    with pytest.raises(MoespecError, match=r"needs TensorStore, which is not installed: pip install 'moespec\[vmoe\]'"):
        _import("orbax")


def test_a_folder_that_is_not_orbax(tmp_path):
    with pytest.raises(MoespecError, match="a folder without _METADATA, not an Orbax checkpoint"):
        open_vmoe(tmp_path)


def test_a_link_inside_an_orbax_folder_is_refused(tmp_path):
    folder = tmp_path / "orbax"
    shutil.copytree(DATA / "orbax", folder)
    (folder / "d" / "outside").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(MoespecError, match=r"outside: a symbolic link inside the Orbax checkpoint"):
        open_vmoe(folder)


S32 = dict(width=512, depth=8, heads=8, mlp=2048, patch=(32, 32), channels=3, moe_blocks=(5, 7), experts=8)
B16 = dict(width=768, depth=12, heads=12, mlp=3072, patch=(16, 16), channels=3, moe_blocks=(1, 3, 5, 7, 9, 11),
           experts=8)
SHIPPED = {  # spec file: (the architecture vmoe's configs give, image, classes, pre_logits, capacity factor)
    "vmoe_s32_last2_e8_top2": (S32, 224, 1000, True, 1.05),
    "vmoe_s32_last2_e8_top2_384": (S32, 384, 1000, False, 1.5),
    "vmoe_b16_every2_e8_top2_21k": (B16, 224, 21843, False, 1.05),
    "vmoe_b16_every2_e8_top2_384": (B16, 384, 1000, False, 1.5),
}


@pytest.mark.parametrize("name", list(SHIPPED))
def test_the_shipped_vmoe_specs_are_what_import_vmoe_builds(name):
    """specs/vmoe_*.yaml, written from vmoe's configs, equal the spec `import_vmoe` makes of a tree of that shape
    at the config's capacity factor and groups of 8 images (the evaluation capacity is the spec file's own)."""
    from moespec.weights.vmoe import VmoeArchitecture

    shape, image, classes, pre_logits, factor = SHIPPED[name]
    arch = VmoeArchitecture(**shape, image=image, classes=classes, pre_logits=pre_logits)
    built = vmoe_spec(arch, top_k=2, capacity_factor=factor, group_size=8 * arch.tokens)
    shipped = moespec.load_spec(Path(__file__).resolve().parents[2] / "specs" / f"{name}.yaml")
    assert shipped.backbone == built.backbone and shipped.input_size == built.input_size
    group, router = shipped.moe[0], shipped.moe[0].router
    assert group.model_copy(update={"router": router.model_copy(update={"eval_capacity_factor": None})}) == \
        built.moe[0]


def test_the_erf_gelu_would_not_match_jax(models):
    """V-MoE's GELU is flax's default, the tanh form: timm's exact GELU is off by more than the tolerance."""
    model = _import()
    for block in model.blocks:
        for ffn in (block.mlp, getattr(block.mlp, "experts", None)):
            if ffn is not None and hasattr(ffn, "act"):
                assert type(ffn.act).__name__ == "GELUTanh"
                ffn.act = torch.nn.GELU()
    with torch.no_grad():
        assert _max_diff(model.forward_features(IMAGES), REFERENCE["encoded_capacity"]) > TOLERANCE


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_orbax_data_file_names_the_folder_and_the_tensor(tmp_path, damage):
    folder = tmp_path / "orbax"
    shutil.copytree(DATA / "orbax", folder)
    data = max((folder / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)  # the arrays' file
    if damage == "truncated":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    else:
        data.unlink()
    with pytest.raises(MoespecError, match=rf"^{folder}: Encoder/\S+: could not be read \(.+\)"):
        _import(folder)

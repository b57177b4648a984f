"""Parameter counts against hand calculations (MACs: test_flops.py)."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest

import moespec
from moespec.counting import flops

from ..compiler.test_sparse_mlp import SMALL
from ..conftest import SPECS_DIR, TINY_CONVNEXT, TINY_VIT, make_spec


def _vit_s16_dense() -> int:
    """ViT-S/16 at 224, 1000 classes, counted by hand (timm lists 22.05M)."""
    patch_embed = 3 * 16 * 16 * 384 + 384
    tokens = 384 + 197 * 384  # cls token + position embedding
    mlp = (384 * 1536 + 1536) + (1536 * 384 + 384)
    block = 2 * 2 * 384 + (384 * 1152 + 1152) + (384 * 384 + 384) + mlp  # 2 LayerNorms, qkv, proj, mlp
    return patch_embed + tokens + 12 * block + 2 * 384 + (384 * 1000 + 1000)


def test_vit_s16_every2_top2_params():
    s = moespec.stats(moespec.load_spec(SPECS_DIR / "vit_s16_moe8_every2_top2.yaml"))
    assert s.dense_params == _vit_s16_dense() == 22_050_664
    expert = (384 * 1536 + 1536) + (1536 * 384 + 384)  # one expert = the dense Mlp
    router = 384 * 8
    # 6 MoE layers (blocks 1, 3, ..., 11), each: the dense Mlp becomes 8 experts + a router
    assert s.total_params == s.dense_params + 6 * (8 * expert + router - expert)
    assert s.activated_params == s.dense_params + 6 * (2 * expert + router - expert)
    assert (s.moe_layers, s.experts_total) == (6, 48)
    assert [layer.path for layer in s.layers] == [f"blocks.{i}.mlp" for i in (1, 3, 5, 7, 9, 11)]
    assert s.layers[0].activated_params == 2 * expert + router and s.layers[0].activated == "per token"


def test_convnext_t_moe4_last2_ratio2_params():
    s = moespec.stats(moespec.load_spec(SPECS_DIR / "convnext_t_moe4_last2_top1.yaml"))
    assert s.dense_params == 28_589_128  # timm / the ConvNeXt paper: 28.6M (checked by the dense spec below)

    def mlp(dim, hidden):
        return (dim * hidden + hidden) + (hidden * dim + dim)

    # stages.2.blocks.8 (dim 384) and stages.3.blocks.2 (dim 768): dense hidden 4*dim, experts 2*dim, 4 experts
    changed = sum(4 * mlp(d, 2 * d) + d * 4 - mlp(d, 4 * d) for d in (384, 768))
    assert s.total_params == s.dense_params + changed
    activated = sum(mlp(d, 2 * d) + d * 4 - mlp(d, 4 * d) for d in (384, 768))
    assert s.activated_params == s.dense_params + activated


@pytest.mark.slow  # a real-size shipped spec traced, about 7 s: CI runs it
def test_convnext_t_moe8_every2_params_against_a_hand_calculation_and_the_paper():
    """The sweet-spot study's ConvNeXt-T "Every 2", 8 experts, top-1 (Table 5 of the TMLR version): 97.5M
    parameters. Every second block of each stage, 7 MoE layers: one in stages 0, 1 and 3 (dims 96, 192, 768),
    four in stage 2 (dim 384). Counting across the stages instead (`{every: 2}`, 9 layers) gives 132.5M."""
    s = moespec.stats(moespec.load_spec(SPECS_DIR / "convnext_t_moe8_every2_top1.yaml"))
    assert s.dense_params == 28_589_128
    dims = [96, 192, 384, 384, 384, 384, 768]

    def mlp(dim):  # fc1 + fc2 at hidden 4 * dim, weights and biases: 8 dim^2 + 5 dim
        return 8 * dim * dim + 5 * dim

    # each layer: the dense Mlp becomes 8 experts and a bias-free router (dim x 8)
    total = s.dense_params + sum(7 * mlp(d) + 8 * d for d in dims)
    assert s.total_params == total == 97_341_352
    assert s.activated_params == s.dense_params + sum(8 * d for d in dims)
    assert (s.moe_layers, s.experts_total) == (7, 56)
    assert abs(s.total_params / 97.5e6 - 1) < 0.01  # the paper's 97.5M, within 1%


@pytest.mark.slow  # DINOv2-S/14 built once and traced four times: about 30 s
def test_dinov2_s14_at_512_px_with_dynamic_img_pad():
    """Seed 003 (ViMoE), Tables 2 and 4: DINOv2-S/14 on ADE20K at 512 px, which timm's dynamic_img_pad pads to
    518 = 37 x 14, the grid of DINOv2's own position table (img_size 518)."""
    spec = moespec.load_spec({"backbone": {"model": "vit_small_patch14_dinov2",
                                           "kwargs": {"num_classes": 150, "dynamic_img_pad": True}},
                              "input_size": [3, 512, 512],
                              "moe": [{"where": {"last": 2}, "experts": 8, "router": {"top_k": 1}}]})
    dim, hidden = 384, 1536
    mlp = 2 * dim * hidden + hidden + dim
    block = 2 * 2 * dim + (dim * 3 * dim + 3 * dim) + (dim * dim + dim) + mlp + 2 * dim  # + 2 LayerScales
    tokens = 1 + 37 * 37
    dense = (3 * 14 * 14 * dim + dim) + dim + tokens * dim + 12 * block + 2 * dim + (dim * 150 + 150)
    s = moespec.stats(spec)
    assert s.dense_params == dense == 22_113_942
    assert s.total_params == dense + 2 * (7 * mlp + dim * 8) == 38_662_038
    assert s.total_params == sum(p.numel() for p in moespec.create_model(spec).parameters())
    at_518 = moespec.stats(spec.model_copy(update={"input_size": (3, 518, 518)}))
    assert s.gmacs == at_518.gmacs  # the padded input is the 518 px one


@pytest.mark.slow  # two real-size shipped specs traced: CI runs it
def test_dense_specs_count_the_backbone():
    for name in ("vit_s16_dense.yaml", "convnext_t_dense.yaml"):
        s = moespec.stats(moespec.load_spec(SPECS_DIR / name))
        assert s.total_params == s.activated_params == s.dense_params and s.moe_layers == 0


@pytest.mark.slow  # traces ViT-H/14 six times: about 30 s
def test_softmoe_h14_params_against_a_hand_calculation_and_the_paper():
    """Soft MoE H/14 (Puigcerver et al., "From Sparse to Soft Mixtures of Experts"): 16 MoE layers of 128 or 256
    experts with one slot each; the paper gives about 27.3B and 54.1B parameters."""
    dim, hidden = 1280, 5120
    expert = 2 * dim * hidden + hidden + dim  # fc1 + fc2, weights and biases: 13,113,600, the dense Mlp
    block = 2 * 2 * dim + (dim * 3 * dim + 3 * dim) + (dim * dim + dim) + expert  # 2 LayerNorms, qkv, proj, mlp
    dense = (3 * 14 * 14 * dim + dim) + dim + 257 * dim + 32 * block + 2 * dim + (dim * 1000 + 1000)
    for name, experts, golden, paper in (("softmoe_h14_e128_half", 128, 27_281_502_456, 27.3e9),
                                         ("softmoe_h14_e256_half", 256, 54_140_776_696, 54.1e9),
                                         ("softmoe_h14_e128_every2", 128, 27_281_502_456, 27.3e9)):
        s = moespec.stats(moespec.load_spec(SPECS_DIR / f"{name}.yaml"))
        assert s.dense_params == dense == 632_045_800
        # each MoE layer: the dense Mlp becomes E experts, Phi (dim x E slots) and Soft MoE's scale; all activated
        total = dense + 16 * (experts * expert + dim * experts + 1 - expert)
        assert s.total_params == s.activated_params == total == golden, name
        assert (s.moe_layers, s.experts_total) == (16, 16 * experts)
        assert round(s.total_params, -8) == paper


@pytest.mark.slow  # three real-size shipped specs built for real: CI runs it
def test_meta_build_counts_the_same_parameters_as_a_real_build():
    """stats() never materializes experts; its counts must equal those of a real build."""
    for name in ("convnext_t_moe4_last2_top1.yaml", "dinov2_s14_image_e4_last3_shared.yaml", "sparse_mlp_s.yaml"):
        spec = moespec.load_spec(SPECS_DIR / name)
        real = moespec.create_model(spec)
        s = moespec.stats(spec)
        assert s.total_params == sum(p.numel() for p in real.parameters()), name
        meta = moespec.create_model(spec, device="meta")
        assert sum(p.numel() for p in meta.parameters()) == s.total_params, name


def test_stats_frees_the_models_it_builds(monkeypatch):
    """Memory does not pile up over specs: once `stats` returns, no module or weight it built is alive, with
    CPython's cycle collector off and never called: nothing it built is in a reference cycle (the fx tracer and
    graph modules are released, the compiled model holds no method bound to itself), so `moespec stats a b c`
    peaks at its largest spec, not at their sum, and pays for no collection of the whole process."""
    built = []  # every module and parameter of the models stats traces: the dense backbone and the compiled one

    def count_macs(model, input_size, **conventions):
        built.extend(weakref.ref(x) for x in (*model.modules(), *model.parameters()))
        return flops.count_macs(model, input_size, **conventions)

    collections = []
    monkeypatch.setattr(sys.modules["moespec.counting.stats"], "count_macs", count_macs)
    specs = [make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4, "top_k": 2}]),
             make_spec(TINY_CONVNEXT, [{"where": {"last": 2}, "experts": 4}]),
             moespec.load_spec({**SMALL, "moe": SMALL["moe"] + [  # a rescale: two traces
                 {"where": {"first": 1}, "sublayer": "mlp_tokens", "experts": 2, "top_k": 1}]})]
    gc.collect()
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args))
    gc.disable()  # deterministic: only what `stats` itself frees is freed
    try:
        for spec in specs:
            built.clear()
            moespec.stats(spec)
            alive = [type(ref()).__name__ for ref in built if ref() is not None]
            assert built and not alive, f"{len(alive)} of {len(built)} still alive: {sorted(set(alive))}"
    finally:
        gc.enable()
    assert collections == []


def test_stats_leaves_the_garbage_collector_as_it_found_it():
    """`stats` neither freezes objects nor collects: afterwards nothing is frozen, and a freeze the caller made
    is left alone."""
    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4, "top_k": 2}])
    assert gc.get_freeze_count() == 0
    moespec.stats(spec)
    assert gc.get_freeze_count() == 0
    kept = [1, 2]
    gc.freeze()
    try:
        moespec.stats(spec)
        assert not any(o is kept for o in gc.get_objects())  # a frozen object is in no generation
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())


def test_stats_allocates_no_weights(monkeypatch):
    """The dense backbone that stats traces has zero-stride views for parameters, its MoE layers are on the meta
    device: a spec of billions of parameters costs no weight memory."""
    weightless = []

    def count_macs(model, input_size, **conventions):
        weightless.append(all(p.device.type == "meta" or p.untyped_storage().nbytes() == p.element_size()
                              for p in model.parameters()))
        return flops.count_macs(model, input_size, **conventions)

    monkeypatch.setattr(sys.modules["moespec.counting.stats"], "count_macs", count_macs)
    moespec.stats(make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4, "top_k": 2}]))
    assert weightless == [True, True]  # the dense backbone, then the compiled model

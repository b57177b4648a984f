"""MACs: fvcore plus our handle table, and MoE layers costed analytically. Golden numbers by hand."""

from __future__ import annotations

import pytest
import torch

import moespec
from moespec.backbones import create_backbone
from moespec.compiler import compile_model
from moespec.counting.flops import MATMUL_LIKE, count_macs
from moespec.planning import plan_for

from ..conftest import SPECS_DIR, TINY_INPUT, TINY_VIT, make_spec

SPECS = sorted(SPECS_DIR.glob("*.yaml"))


def _vit_s16_macs() -> int:
    """ViT-S/16 at 224 by hand: 196 patches + cls = 197 tokens, width 384, 6 heads of 64, MLP 1536."""
    tokens, dim, hidden = 197, 384, 1536
    patch_embed = 196 * (3 * 16 * 16) * dim
    attention_products = 2 * 6 * tokens * tokens * 64  # QK^T and AV
    block = (tokens * dim * 3 * dim + attention_products + tokens * dim * dim + 2 * tokens * dim * hidden
             + 2 * 5 * tokens * dim)  # qkv, attention, proj, fc1 + fc2, two affine LayerNorms (5 per element)
    return patch_embed + 12 * block + 5 * tokens * dim + dim * 1000  # + final norm + head


def test_dense_vit_small_golden():
    s = moespec.stats(moespec.load_spec(SPECS_DIR / "vit_s16_dense.yaml"))
    assert s.dense_params == s.total_params == 22_050_664
    assert round(s.gmacs * 1e9) == _vit_s16_macs()
    assert s.gmacs == pytest.approx(4.25 + 0.36, rel=0.005)  # fvcore's 4.25 + attention products 0.36
    assert 12 * 2 * 6 * 197 * 197 * 64 / 1e9 == pytest.approx(0.36, abs=0.005)


def test_dense_convnext_tiny_golden():
    s = moespec.stats(moespec.load_spec(SPECS_DIR / "convnext_t_dense.yaml"))
    assert s.dense_params == 28_589_128
    assert s.gmacs == s.dense_gmacs == pytest.approx(4.47, rel=0.005)  # ConvNeXt paper / timm: 4.5 GFLOPs


def vit(dim: int, depth: int, patch: int, img: int = 224, classes: int = 1000, layerscale: bool = False):
    """Dense timm ViT by hand: (params, MACs). Tokens N = (img/patch)^2 + 1; qkv/proj/fc with biases; two
    LayerNorms per block (5 MACs per element, fvcore); QK^T + AV = 2 N^2 dim; mlp_ratio 4."""
    n = (img // patch) ** 2 + 1
    block = (4 * dim + (3 * dim * dim + 3 * dim) + (dim * dim + dim) + _ffn(dim, 4 * dim)
             + (2 * dim if layerscale else 0))
    params = (3 * patch * patch * dim + dim) + dim + n * dim + depth * block + 2 * dim + dim * classes + classes
    block_macs = n * 3 * dim * dim + 2 * n * n * dim + n * dim * dim + 2 * n * dim * 4 * dim + 2 * 5 * n * dim
    macs = (img // patch) ** 2 * 3 * patch * patch * dim + depth * block_macs + 5 * n * dim + dim * classes
    return params, macs


def _ffn(dim: int, hidden: int) -> int:
    return dim * hidden + hidden + hidden * dim + dim


# Dense backbones: ViTs by hand; ConvNeXts from their paper (params exact from timm, GMACs +-0.5%).
DENSE = {
    "vit_small_patch16_224": vit(384, 12, 16),
    "vit_base_patch16_224": vit(768, 12, 16),  # 86.6M, 17.6 GMACs (fvcore 16.87 + attention 0.72)
    "vit_large_patch16_224": vit(1024, 24, 16),  # 304.3M, 61.6 GMACs
    "vit_huge_patch14_224": vit(1280, 32, 14),  # 632.0M, 167.4 GMACs
    "vit_small_patch14_dinov2": vit(384, 12, 14, layerscale=True),  # at img_size 224: 257 tokens
    "vit_small_patch16_224@14": vit(384, 12, 14),  # ViT-S with patch_size 14
    # V-MoE's ViTs (specs/vmoe_*): S is width 512, depth 8; the S/32 at 224 with the pre_logits layer (D^2 + D
    # parameters, D^2 MACs); B/16 on ImageNet-21k's 21,843 classes; the fine-tunes at 384 px (145 and 577 tokens)
    "vmoe_s32_pre_logits": tuple(a + b for a, b in zip(vit(512, 8, 32), (512 * 512 + 512, 512 * 512), strict=True)),
    "vmoe_s32@384": vit(512, 8, 32, img=384),
    "vmoe_b16_21k": vit(768, 12, 16, classes=21843),
    "vmoe_b16@384": vit(768, 12, 16, img=384),
    "convnext_tiny": (28_589_128, 4.47e9),
    "convnext_small": (50_223_688, 8.70e9),
    "convnext_base": (88_591_464, 15.38e9),
}
# ConvNeXt stages: (width, positions at 224) for stage 0..3
CONVNEXT_T_S = [(96, 56 * 56), (192, 28 * 28), (384, 14 * 14), (768, 7 * 7)]
CONVNEXT_B = [(128, 56 * 56), (256, 28 * 28), (512, 14 * 14), (1024, 7 * 7)]


def _layers(count, kind, dim, items, experts, top_k=1, ratio=4, shared=0):
    """`count` identical MoE layers: (kind, width, dense hidden, expert hidden, E, k, items, shared)."""
    return [(kind, dim, 4 * dim, ratio * dim, experts, top_k, items, shared)] * count


def _convnext(stage_counts, stages, experts, ratio=4):
    return [layer for (dim, items), count in zip(stages, stage_counts, strict=True)
            for layer in _layers(count, "topk", dim, items, experts, 1, ratio)]


# Per shipped spec: the dense backbone key and its MoE layers, written from the spec by hand.
EXPECTED = {
    "vit_s16_dense": ("vit_small_patch16_224", []),
    "convnext_t_dense": ("convnext_tiny", []),
    "vit_s16_moe8_every2_top2": ("vit_small_patch16_224", _layers(6, "topk", 384, 197, 8, 2)),  # blocks 1,3,..,11
    "vit_s16_moe8_last2_top2": ("vit_small_patch16_224", _layers(2, "topk", 384, 197, 8, 2)),
    "vit_b16_moe8_every2_top2": ("vit_base_patch16_224", _layers(6, "topk", 768, 197, 8, 2)),
    "convnext_t_moe4_last2_top1": ("convnext_tiny", _convnext([0, 0, 1, 1], CONVNEXT_T_S, 4, ratio=2)),
    "convnext_s_moe4_last2_top1": ("convnext_small", _convnext([0, 0, 1, 1], CONVNEXT_T_S, 4, ratio=2)),
    "convnext_b_moe4_last2_top1": ("convnext_base", _convnext([0, 0, 1, 1], CONVNEXT_B, 4, ratio=2)),
    "convnext_t_moe8_last2_top1": ("convnext_tiny", _convnext([0, 0, 1, 1], CONVNEXT_T_S, 8)),
    "convnext_t_moe8_stage_top1": ("convnext_tiny", _convnext([1, 1, 1, 1], CONVNEXT_T_S, 8)),
    # Every 2 within each stage of (3, 3, 9, 3) blocks: 1 | 1 | 1, 3, 5, 7 | 1
    "convnext_t_moe8_every2_top1": ("convnext_tiny", _convnext([1, 1, 4, 1], CONVNEXT_T_S, 8)),
    "convnext_t_moe8_last3_top1": ("convnext_tiny", _convnext([0, 0, 2, 1], CONVNEXT_T_S, 8)),  # + stages.2.blocks.4
    **{f"dinov2_s14_image_e{n}_last{depth}{suffix}": (
        "vit_small_patch14_dinov2", _layers(depth, "image", 384, 257, n, 1, shared=int(bool(suffix))))
       for n, depth in ((2, 5), (4, 3), (8, 2)) for suffix in ("", "_shared")},
    **{f"dinov2_s14_image_e{n}_all_shared": ("vit_small_patch14_dinov2", _layers(12, "image", 384, 257, n, 1, shared=1))
       for n in (2, 4, 8)},
    "softmoe_s16_e128_half": ("vit_small_patch16_224", _layers(6, "soft", 384, 197, 128)),
    "softmoe_b16_e128_half": ("vit_base_patch16_224", _layers(6, "soft", 768, 197, 128)),
    "softmoe_l16_e128_half": ("vit_large_patch16_224", _layers(12, "soft", 1024, 197, 128)),
    "softmoe_s14_e256_half": ("vit_small_patch16_224@14", _layers(6, "soft", 384, 257, 256)),
    "softmoe_h14_e128_half": ("vit_huge_patch14_224", _layers(16, "soft", 1280, 257, 128)),
    "softmoe_h14_e256_half": ("vit_huge_patch14_224", _layers(16, "soft", 1280, 257, 256)),
    "softmoe_h14_e128_every2": ("vit_huge_patch14_224", _layers(16, "soft", 1280, 257, 128)),  # blocks 1, 3, .., 31
    # the upcycling recipes: expert choice at c = 2 (in the top_k slot), top-2 in every block, top-2 every 2
    "upcycle_vit_b16_ec32_every2": ("vit_base_patch16_224", _layers(6, "expert_choice", 768, 197, 32, 2)),
    "upcycle_vit_s16_drop_e8_top2": ("vit_small_patch16_224", _layers(12, "topk", 384, 197, 8, 2)),
    "upcycle_vit_s16_multisource_e4_top2": ("vit_small_patch16_224", _layers(6, "topk", 384, 197, 4, 2)),
    # the released V-MoE checkpoints: 8 experts, top-2, "Last 2" (blocks 5, 7) and "Every 2" (1, 3, .., 11)
    "vmoe_s32_last2_e8_top2": ("vmoe_s32_pre_logits", _layers(2, "topk", 512, 50, 8, 2)),
    "vmoe_s32_last2_e8_top2_384": ("vmoe_s32@384", _layers(2, "topk", 512, 145, 8, 2)),
    "vmoe_b16_every2_e8_top2_21k": ("vmoe_b16_21k", _layers(6, "topk", 768, 197, 8, 2)),
    "vmoe_b16_every2_e8_top2_384": ("vmoe_b16@384", _layers(6, "topk", 768, 577, 8, 2)),
}


def expected_counts(layers, dense_params, dense_macs):
    """(total params, activated params, activated MACs) from the per-layer formulas.

    topk / image: the dense FFN becomes E experts of width h, plus a router (C x E) and shared experts;
      activated: k experts. MACs per item: k expert FFNs (2 C h) + the weighted combine (k C) + shared
      experts, instead of the dense FFN; the router costs C x E per item (topk) or per image (image).
    soft: E experts, Phi (C x S) and a scale; everything is activated. MACs per image: logits, dispatch and
      combine (3 N S C) and S slot FFNs, instead of N dense FFNs.
    expert_choice (capacity c in the top_k slot): each expert takes round(c N / E) of the N items, so E of
      them make rows = E round(c N / E) expert passes per image (32 x round(2 x 197 / 32) = 32 x 12 = 384), each
      an expert FFN plus its combine (2 C h + C); activated: rows / N experts per item, rounded in parameters.
    """
    total, activated, macs = dense_params, dense_params, dense_macs
    for kind, dim, dense_hidden, hidden, experts, top_k, items, shared in layers:
        expert, dense = _ffn(dim, hidden), _ffn(dim, dense_hidden)
        if kind == "soft":
            slots = experts  # one slot per expert
            total += experts * expert + dim * slots + 1 - dense
            activated += experts * expert + dim * slots + 1 - dense
            macs += 3 * items * slots * dim + slots * 2 * dim * hidden - items * 2 * dim * dense_hidden
            continue
        router = dim * experts
        if kind == "expert_choice":
            rows = experts * min(items, max(1, round(top_k * items / experts)))
            total += experts * expert + router - dense
            activated += round(rows / items * expert) + router - dense
            macs += router * items + rows * (2 * dim * hidden + dim) - items * 2 * dim * dense_hidden
            continue
        total += (experts + shared) * expert + router - dense
        activated += (top_k + shared) * expert + router - dense
        router_macs = router * (1 if kind == "image" else items)
        macs += router_macs + items * ((top_k + shared) * 2 * dim * hidden + top_k * dim - 2 * dim * dense_hidden)
    return total, activated, macs


def test_every_shipped_spec_has_a_hand_written_expectation():
    from ..compiler.test_sparse_mlp import SPARSE_SPECS

    assert {p.stem for p in SPECS} == set(EXPECTED) | set(SPARSE_SPECS)


@pytest.mark.slow  # builds every real-size shipped backbone: about 40 s
@pytest.mark.parametrize("path", [SPECS_DIR / f"{name}.yaml" for name in EXPECTED], ids=list(EXPECTED))
def test_shipped_spec_counts_follow_the_formulas(path):
    s = moespec.stats(moespec.load_spec(path))
    backbone, layers = EXPECTED[path.stem]
    dense_params, dense_macs = DENSE[backbone]
    assert s.dense_params == dense_params
    assert s.dense_gmacs * 1e9 == pytest.approx(dense_macs, rel=0.005)
    total, activated, macs = expected_counts(layers, s.dense_params, s.dense_gmacs * 1e9)
    assert s.total_params == total
    assert s.activated_params == activated
    assert s.gmacs * 1e9 == pytest.approx(macs, rel=0.001)
    assert [(layer.items, layer.experts) for layer in s.layers] == [(items, e) for *_, e, _, items, _ in layers]


@pytest.mark.slow
@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_no_matmul_like_op_is_left_uncounted(path):
    spec = moespec.load_spec(path)
    backbone = create_backbone(spec)
    plan = plan_for(spec, backbone)
    counted = count_macs(compile_model(backbone, plan, moe_device="meta"), plan.input_size)  # experts never run
    assert not [op for op in counted.unsupported if MATMUL_LIKE.search(op)], counted.unsupported


def test_moe_cost_is_analytic_and_independent_of_routing():
    """E = k = 1 costs exactly the dense model plus, per token, the router (C x 1) and the combine (C)."""
    spec = make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 1, "top_k": 1}])
    s = moespec.stats(spec)
    tokens = (64 // 16) ** 2 + 1
    assert round(s.gmacs * 1e9) == round(s.dense_gmacs * 1e9) + 2 * tokens * (384 + 384)
    torch.manual_seed(1)
    other = moespec.stats(make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 8, "top_k": 2}]))
    torch.manual_seed(2)
    again = moespec.stats(make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 8, "top_k": 2}]))
    assert other.gmacs == again.gmacs


def test_capacity_factor_reports_the_padded_figure():
    spec = make_spec(TINY_VIT, [{"where": {"last": 1}, "experts": 4, "top_k": 2, "capacity_factor": 1.25}])
    layer = moespec.stats(spec).layers[0]
    tokens = 17
    capacity = -(-125 * 2 * tokens // (100 * 4))  # ceil(1.25 * 2 * 17 / 4) = 11
    expert = 2 * 384 * 1536
    assert layer.items == tokens
    assert round(layer.gmacs * 1e9) == tokens * (384 * 4 + 2 * expert + 2 * 384)
    assert round(layer.executed_gmacs * 1e9) == tokens * 384 * 4 + 4 * capacity * (expert + 384)


def test_input_size_override_and_a_size_the_model_cannot_take():
    spec = make_spec({"model": "convnext_tiny", "kwargs": {"depths": (1, 1, 2, 1)}}, [])
    small, large = moespec.stats(spec, input_size=(3, 64, 64)), moespec.stats(spec, input_size=(3, 128, 128))
    head = 5 * 768 + 768 * 1000  # LayerNorm + fc on the pooled vector: the same at any size
    assert large.input_size == (3, 128, 128)
    assert large.gmacs * 1e9 - head == pytest.approx(4 * (small.gmacs * 1e9 - head), rel=1e-9)  # 4x the pixels
    vit = moespec.stats(make_spec(TINY_VIT, []), input_size=(3, 96, 96))  # built at img_size 96: 36 patches
    assert vit.input_size == (3, 96, 96)
    assert vit.total_params == moespec.stats(make_spec(TINY_VIT, [])).total_params + 20 * 384  # pos_embed: 37 tokens
    with pytest.raises(moespec.SpecError, match=r"^--input-size 3 16 16: the model cannot take it: "):
        moespec.stats(spec, input_size=(3, 16, 16))  # ConvNeXt's last downsampling conv is larger than its input
    assert TINY_INPUT == [3, 64, 64]


def test_each_router_kind_is_costed_by_its_formula():
    """Tiny ViT-S (17 tokens, C = 384, FFN 384 -> 1536 -> 384), one MoE layer per spec, 4 experts."""
    tokens, dim, hidden = 17, 384, 1536
    ffn = 2 * dim * hidden  # one expert FFN per item
    cases = {
        # token top-2, cosine gate (projection to 16, codes 16 x 4): gate + 2 experts + combine per token
        "topk-cosine": ({"gate": {"kind": "cosine", "dim": 16}}, 2, tokens * (dim * 16 + 16 * 4 + 2 * (ffn + dim))),
        # importance-score routing drops floor(0.1 * 17) = 1 row from dispatch; the gate still sees all 17
        "drop": ({"drop_fraction": 0.1}, 1, tokens * dim * 4 + (tokens - 1) * (ffn + dim)),
        # image routing: one gate decision per image, every token through k experts
        "image": ({"kind": "image"}, 2, dim * 4 + tokens * 2 * (ffn + dim)),
        # expert choice with c = 2: C = round(2 * 17 / 4) = 8 tokens per expert, 32 rows = about c per token
        "expert_choice": ({"kind": "expert_choice", "capacity": 2.0}, 1, tokens * dim * 4 + 4 * 8 * (ffn + dim)),
        # Soft MoE, 4 experts x 2 slots: logits, dispatch, combine (3 N S C) + S slot FFNs per image
        "soft": ({"kind": "soft", "slots_per_expert": 2}, 1, 3 * tokens * 8 * dim + 8 * ffn),
    }
    for name, (router, top_k, expected) in cases.items():
        spec = make_spec(TINY_VIT, [{"where": {"last": 1}, "experts": 4, "top_k": top_k, "router": router}])
        layer = moespec.stats(spec).layers[0]
        assert round(layer.gmacs * 1e9) == expected, name


def test_a_failed_trace_leaves_the_model_as_it_was(monkeypatch):
    """fvcore hooks every module before its trace and unhooks them only when the trace succeeds (issue 52: a
    failed trace left the model unpicklable); `count_macs` leaves the model's hooks as they were either way."""
    import io

    import fvcore.nn.jit_analysis

    model = moespec.create_model(make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4}]), seed=0)
    own = model.blocks[0].register_forward_hook(lambda module, args, output: None)  # the user's: kept

    def fail(*args, **kwargs):
        raise RuntimeError("the tracer refused an op")

    monkeypatch.setattr(fvcore.nn.jit_analysis, "_get_trace_graph", fail)
    with pytest.raises(RuntimeError, match="the tracer refused an op"):
        count_macs(model, tuple(TINY_INPUT))
    hooked = {name: (list(m._forward_pre_hooks), list(m._forward_hooks)) for name, m in model.named_modules()
              if m._forward_pre_hooks or m._forward_hooks}
    assert hooked == {"blocks.0": ([], [own.id])} and model.training
    own.remove()
    torch.save(model, io.BytesIO())

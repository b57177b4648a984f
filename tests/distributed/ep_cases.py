"""The expert-parallel test matrix: each case is one MoE spec on a tiny timm backbone, run by `ep_worker.py`
on W gloo ranks against one process on the whole batch."""

from __future__ import annotations

VIT = {"model": "vit_small_patch16_224",
       "kwargs": {"depth": 2, "img_size": 32, "embed_dim": 32, "num_heads": 2, "num_classes": 10}}
EVA_SWIGLU_NORM = {"model": "eva02_tiny_patch14_224",  # SwiGLU experts with an inner LayerNorm
                   "kwargs": {"depth": 2, "img_size": 28, "embed_dim": 32, "num_heads": 2, "scale_mlp": True,
                              "num_classes": 10}}
CONVNEXT_GRN = {"model": "convnextv2_atto", "kwargs": {"depths": (1, 1, 2, 1), "num_classes": 10}}  # GRN experts
CLIPPED_GLU = {"model": "moespec_test_family_net", "kwargs": {"family": "Gemma4GatedMlpClipped"}}  # clamped GLU
INPUT = {"vit": [3, 32, 32], "eva": [3, 28, 28], "convnext": [3, 32, 32]}

EVERY = {"every": 1}
CASES: dict[str, tuple[dict, list[dict]]] = {
    "topk1": (VIT, [{"where": EVERY, "experts": 8, "top_k": 1, "aux_loss": {"kind": "switch"}}]),
    "topk2-cosine": (VIT, [{"where": EVERY, "experts": 4, "top_k": 2, "aux_loss": {"kind": "importance_load"},
                            "router": {"kind": "topk", "normalize": True, "gate": {"kind": "cosine"}}}]),
    "capacity-bpr": (VIT, [{"where": EVERY, "experts": 4, "top_k": 2, "capacity_factor": 1.0,
                            "router": {"kind": "topk", "bpr": True}, "aux_loss": {"kind": "z_loss"}}]),
    "importance-drop": (VIT, [{"where": EVERY, "experts": 4, "top_k": 1,
                               "router": {"kind": "topk", "drop_fraction": 0.4}}]),
    "expert-choice": (VIT, [{"where": EVERY, "experts": 4, "router": {"kind": "expert_choice", "capacity": 1.0}}]),
    "image": (VIT, [{"where": EVERY, "experts": 4, "top_k": 1, "router": {"kind": "image"}}]),
    "soft": (VIT, [{"where": EVERY, "experts": 8, "router": {"kind": "soft", "slots_per_expert": 2}}]),
    "shared": (VIT, [{"where": EVERY, "experts": 4, "top_k": 2, "shared_experts": 1}]),
    "swiglu-norm": (EVA_SWIGLU_NORM, [{"where": EVERY, "experts": 4, "top_k": 2}]),
    "grn": (CONVNEXT_GRN, [{"where": {"stage_last": 2}, "experts": 4, "top_k": 1}]),
    "clamped-glu": (CLIPPED_GLU, [{"where": EVERY, "experts": 4, "top_k": 2}]),
    # DeepSeek-V3's routing: sigmoid scores, a route scale, group-limited top-k and the balancing bias, updated
    # from the global loads (the worker starts the bias random, so that it changes the choices)
    "deepseek-v3": (VIT, [{"where": EVERY, "experts": 8, "aux_loss": [], "router": {
        "kind": "topk", "top_k": 2, "score": "sigmoid", "scale": 2.5, "groups": {"count": 4, "top": 2},
        "bias_balance": {"rate": 0.01}}}]),
    "topk2-fp32": (VIT, [{"where": EVERY, "experts": 4, "top_k": 2}]),  # in float32: equal to 1e-5
    # every gate weight 0: all logits tie, every item goes to expert 0, the other ranks receive no rows
    "one-expert": (VIT, [{"where": EVERY, "experts": 4, "top_k": 1}]),
}


def input_size(backbone: dict) -> list[int]:
    return INPUT["eva" if "eva" in backbone["model"] else "convnext" if "convnext" in backbone["model"] else "vit"]

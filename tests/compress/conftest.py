"""Tiny hand-built MoE models for the compress tests."""

from __future__ import annotations

import pytest
import torch

import moespec

DIM = 96  # the tiny ViT's width (embed_dim), MLP hidden 4 * 96 = 384


def tiny_spec(experts: int = 4, top_k: int = 2, normalize: bool = True, **group) -> moespec.Spec:
    """A 2-block ViT/16 of width 96 (3 heads) at 32 px (4 patches + CLS), one MoE layer in block 1."""
    return moespec.load_spec({
        "name": "tiny",
        "backbone": {"model": "vit_small_patch16_224", "kwargs": {"depth": 2, "img_size": 32, "num_classes": 10,
                                                                      "embed_dim": DIM, "num_heads": 3}},
        "input_size": [3, 32, 32],
        "moe": [{"where": {"blocks": [1]}, "experts": experts,
                 "router": {"kind": "topk", "top_k": top_k, "normalize": normalize}, **group}],
    })


def never_choose(model, unused: list[int]) -> None:
    """Make the experts `unused` of block 1's layer never chosen, for any input: the gate sees the output of
    norm2, a LayerNorm, whose entries minus its bias sum to 0 over the channels; with norm2's bias all 1 a gate
    row along the all-ones vector scores every item sum(bias) = DIM times its scale. The other rows get +1, the
    unused ones -1 along it, plus a small random part that keeps the routing of the others data-dependent."""
    with torch.no_grad():
        block = model.blocks[1]
        block.norm2.bias.fill_(1.0)
        gate = block.mlp.router.gate.weight  # [E, DIM]
        gate.copy_(torch.randn(gate.shape, generator=torch.Generator().manual_seed(1)) * 1e-3)
        for e in range(gate.shape[0]):
            gate[e] += (-1.0 if e in unused else 1.0) / DIM


@pytest.fixture
def images():
    return torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(0))

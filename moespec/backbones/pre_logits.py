"""ViT's representation layer, `backbone.pre_logits: true`: the pooled token through a Linear and a tanh before the
head (Dosovitskiy et al. 2021, `representation_size`). Google's ViT and V-MoE checkpoints trained on ImageNet have
it (`pre_logits/kernel`); timm's `VisionTransformer` dropped the field."""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..errors import Problem, SpecError


class PreLogits(nn.Module):
    """`tanh(fc(norm(x)))` on the pooled features [B, D]: the norm that was in timm's `fc_norm` place (an Identity
    for [CLS] pooling), then ViT's representation layer, D -> D."""

    def __init__(self, norm: nn.Module, width: int):
        super().__init__()
        self.norm = norm
        self.fc = nn.Linear(width, width)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(self.norm(x)))


def add_pre_logits(model: nn.Module, name: str) -> nn.Module:
    """`model` with a `PreLogits` in its `fc_norm` place: timm's `forward_head` runs pool, fc_norm, head_drop,
    head, so `forward_head(x, pre_logits=True)` returns the representation, and `reset_classifier` (which replaces
    only the head) keeps it. Only a timm `VisionTransformer` has that place."""
    if not isinstance(model, VisionTransformer):
        raise SpecError(Problem(f"pre_logits is ViT's representation layer, put in timm VisionTransformer's fc_norm "
                                f"place; {name} is a {type(model).__name__}, which has none",
                                path="backbone.pre_logits"))
    model.fc_norm = PreLogits(model.fc_norm, model.embed_dim)
    return model

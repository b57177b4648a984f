"""The FFN classes of timm's model files and `timm.layers` that are compositions of plain parts, one declaration
each (`composed.py` says what the fields mean), and those that cannot be split into experts, with the reason.
A new family is one class here.
"""

from __future__ import annotations

import importlib

from timm.layers import GatedMlp
from torch import nn

from .adapters import Adapter, register_adapter
from .composed import ComposedAdapter


def timm_class(module: str, name: str) -> type[nn.Module] | None:
    """`timm.models.<module>.<name>`, or None where this timm has no such model file or class (the families
    of newer timm releases register only there)."""
    try:
        return getattr(importlib.import_module(f"timm.models.{module}"), name, None)
    except ImportError:
        return None


@register_adapter(timm_class("tiny_vit", "NormMlp"))
class NormMlpAdapter(ComposedAdapter):
    """TinyViT: LayerNorm -> fc1 -> act -> fc2; the norm is shared, before routing."""

    family, pre, drop = "NormMlp", "norm", ("drop1", "drop2")


@register_adapter(timm_class("swiftformer", "Mlp"))
class SwiftFormerMlpAdapter(ComposedAdapter):
    """SwiftFormer: BatchNorm -> 1x1 conv fc1 -> act -> 1x1 conv fc2; the norm is shared, before routing."""

    family, pre, drop = "SwiftFormerMlp", "norm1", ("drop", "drop")


@register_adapter(timm_class("fastvit", "ConvMlp"))
class FastVitConvMlpAdapter(ComposedAdapter):
    """FastViT: 7x7 depthwise conv + BatchNorm -> 1x1 conv fc1 -> act -> 1x1 conv fc2; the depthwise conv is
    shared, before routing."""

    family, pre, drop = "FastVitConvMlp", "conv", ("drop", "drop")


@register_adapter(timm_class("inception_next", "ConvMlp"))
class InceptionNextConvMlpAdapter(ComposedAdapter):
    """InceptionNeXt: 1x1 conv fc1 -> [BatchNorm] -> act -> 1x1 conv fc2."""

    family, fc1, drop = "InceptionNextConvMlp", ("fc1", "norm"), ("drop", None)


@register_adapter(timm_class("efficientformer", "ConvMlpWithNorm"))
class EfficientFormerConvMlpAdapter(ComposedAdapter):
    """EfficientFormer: 1x1 conv + BatchNorm -> act -> 1x1 conv + BatchNorm."""

    family, fc1, fc2, drop = "EfficientFormerConvMlp", ("fc1", "norm1"), ("fc2", "norm2"), ("drop", "drop")


@register_adapter(timm_class("efficientformer_v2", "ConvMlpWithNorm"))
class EfficientFormerV2ConvMlpAdapter(ComposedAdapter):
    """EfficientFormer-V2: ConvNormAct fc1 (its act inside the BatchNormAct) -> ConvNorm fc2; with the 3x3
    depthwise `mid` conv, whole copies under image routing only."""

    family, act, drop = "EfficientFormerV2ConvMlp", "fc1.bn.act", ("drop1", "drop2")

    def mixes_positions(self, ffn: nn.Module) -> str | None:
        if not isinstance(ffn.mid, nn.Identity):
            return "its 3x3 depthwise conv `mid` between fc1 and fc2 mixes neighbouring positions of the hidden layer"
        return None


@register_adapter(timm_class("levit", "LevitMlp"))
class LevitMlpAdapter(ComposedAdapter):
    """LeViT: Linear (or 1x1 conv) + BatchNorm -> act -> Linear + BatchNorm."""

    family, fc1, fc2, drop = "LevitMlp", "ln1", "ln2", ("drop", None)


@register_adapter(timm_class("repvit", "RepVitMlp"))
class RepVitMlpAdapter(ComposedAdapter):
    """RepViT: ConvNorm -> act -> ConvNorm."""

    family, fc1, fc2 = "RepVitMlp", "conv1", "conv2"


@register_adapter(timm_class("efficientvit_msra", "ConvMlp"), timm_class("shvit", "FFN"))
class PointwiseConvNormAdapter(ComposedAdapter):
    """EfficientViT (MSRA) `ConvMlp` and SHViT `FFN`: ConvNorm pw1 -> act -> ConvNorm pw2."""

    family, fc1, fc2 = "PointwiseConvNormMlp", "pw1", "pw2"


@register_adapter(timm_class("efficientvim", "FFN"))
class EfficientVimFFNAdapter(ComposedAdapter):
    """EfficientViM: ConvLayer2d fc1 (conv, BatchNorm, act) -> ConvLayer2d fc2 (conv, BatchNorm)."""

    family, act = "EfficientVimFFN", "fc1.act"


@register_adapter(timm_class("visformer", "SpatialMlp"))
class SpatialMlpAdapter(ComposedAdapter):
    """Visformer: 1x1 conv -> act -> 1x1 conv; not with the grouped 3x3 `conv2` of `spatial_conv`."""

    family, fc1, act, fc2, drop = "SpatialMlp", "conv1", "act1", "conv3", ("drop1", "drop3")

    def refusal(self, ffn: nn.Module) -> str | None:
        if ffn.conv2 is not None:
            return ("its grouped 3x3 conv `conv2` between conv1 and conv3 mixes neighbouring positions of the hidden "
                    "layer")
        return super().refusal(ffn)


@register_adapter(GatedMlp)
class GatedMlpAdapter(ComposedAdapter):
    """timm `GatedMlp` without a gate layer or norm (then fc1 -> act -> fc2); with gMLP's spatial gating unit,
    whole copies under image routing only."""

    family, drop = "GatedMlp", ("drop1", "drop2")

    def mixes_positions(self, ffn: nn.Module) -> str | None:
        if not isinstance(ffn.gate, nn.Identity):
            return f"its gate ({type(ffn.gate).__name__}) mixes the tokens of a sequence"
        return None

    def refusal(self, ffn: nn.Module) -> str | None:
        if isinstance(ffn.gate, nn.Identity) and not isinstance(ffn.norm, nn.Identity):
            return f"its inner norm ({type(ffn.norm).__name__}) after the gate is not one moespec experts have"
        return super().refusal(ffn)


@register_adapter(timm_class("vitamin", "GeGluMlp"))
class GeGluMlpAdapter(ComposedAdapter):
    """ViTamin: LayerNorm -> act(w0 x) * w1 x -> w2; the norm is shared, before routing."""

    family, pre, fc1, up, fc2, drop = "GeGluMlp", "norm", "w0", "w1", "w2", ("drop1", "drop2")


@register_adapter(timm_class("gemma4_vit", "Gemma4GatedMlp"))
class Gemma4GatedMlpAdapter(ComposedAdapter):
    """Gemma 4 vision: act(gate_proj x) * up_proj x -> down_proj, each a linear that may clamp its input and
    output (its bounds go to `Experts.clamp`)."""

    family, fc1, up, fc2, drop = "Gemma4GatedMlp", "gate_proj", "up_proj", "down_proj", (None, "drop")


@register_adapter(timm_class("pvt_v2", "MlpWithDepthwiseConv"))
class MlpWithDepthwiseConvAdapter(Adapter):
    """PVT-v2: fc1 -> 3x3 depthwise conv -> act -> fc2, called as mlp(x, feat_size); whole copies under image
    routing only."""

    family = "MlpWithDepthwiseConv"

    def mixes_positions(self, ffn: nn.Module) -> str | None:
        return "its 3x3 depthwise conv `dwconv` between fc1 and fc2 mixes neighbouring positions of the hidden layer"

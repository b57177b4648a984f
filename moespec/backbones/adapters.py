"""FFN adapters: one per timm FFN family, in one registry.

An adapter knows three things about its family: the FFN's shape (`in -> hidden -> out`, channels-last or
channels-first), how to build an `Experts` bank with the same structure at another hidden width, and how
to cut one expert's weights out of the dense FFN's weights (for upcycling).

    Mlp, GluMlp (SwiGLUPacked), SwiGLU, ConvMlp, GlobalResponseNormMlp     here, with inner norms
    FFNs composed of plain parts (LeViT, RepViT, TinyViT, ...)             `composed.py`, `families.py`
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from timm.layers import ConvMlp, GlobalResponseNormMlp, GluMlp, Mlp, SwiGLU
from timm.layers.grn import GlobalResponseNorm
from torch import nn

from ..errors import MoespecError
from ..layers import Experts
from ..spec import FFNShape


class Adapter:
    """How moespec reads, rebuilds and upcycles one FFN family. Subclasses say how their FFN is built
    (`options`) and how one expert's weights are cut from it (`expert_state`)."""

    family: str = ""

    def shape(self, ffn: nn.Module) -> FFNShape:
        fc1, fc2 = ffn.fc1, ffn.fc2
        channels_dim = 1 if isinstance(fc1, nn.Conv2d) else -1
        return FFNShape(self.family, _in(fc1), _in(fc2), _out(fc2), channels_dim)

    def build_experts(self, ffn: nn.Module, num_experts: int, hidden: int) -> Experts:
        """`num_experts` experts with `ffn`'s structure at `hidden` width (fresh init)."""
        s = self.shape(ffn)
        return Experts(num_experts, s.in_features, hidden, s.out_features, act=copy.deepcopy(ffn.act),
                       **self.options(ffn))

    def options(self, ffn: nn.Module) -> dict:
        """`Experts` keyword arguments that reproduce `ffn`: glu, inner_norm, norm_eps, bias, drop."""
        raise NotImplementedError

    def expert_state(self, dense: dict[str, torch.Tensor], units: torch.Tensor) -> dict[str, torch.Tensor]:
        """One expert's tensors (names of `Experts` without the expert axis) from the dense FFN's state
        dict (names relative to the FFN), keeping the hidden units `units` (a LongTensor)."""
        return _plain_state(dense, units, norm="norm")

    def bank_buffers(self, dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The bank's buffers (`Experts`' own names), the same for every expert, from the dense FFN's state
        dict: Gemma 4's clamp bounds. Upcycling copies them."""
        return {}

    def matches(self, module: nn.Module) -> bool:
        """Whether `module`, an instance of a registered class, is an FFN of this family (a structural
        adapter, registered for a generic class such as `nn.Sequential`, checks the children)."""
        return True

    def refusal(self, ffn: nn.Module) -> str | None:
        """Why `ffn` cannot be split into experts, or None."""
        return None

    def mixes_positions(self, ffn: nn.Module) -> str | None:
        """Why `ffn` mixes positions (a depthwise conv or a spatial gate between its projections), or None. Such
        an FFN cannot be split into per-position experts, since an expert sees only the positions routed to it;
        under image-level routing each expert is a whole copy of it (`layers.ImageFFNMoE`)."""
        return None

    def pre_module(self, ffn: nn.Module) -> nn.Module | None:
        """A copy of the module `ffn` applies to its input before its first projection (a norm, a depthwise
        conv), which the MoE layer keeps dense and shared (`MoELayer.pre`), or None."""
        return None

    def pre_state(self, dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state dict of `pre_module`, from the dense FFN's state dict."""
        return {}


ADAPTERS: dict[type[nn.Module], Adapter] = {}


def register_adapter(*families: type[nn.Module]) -> Callable[[type[Adapter]], type[Adapter]]:
    def wrap(cls: type[Adapter]) -> type[Adapter]:
        for family in families:
            if family is not None:  # a class this timm does not have (`families.timm_class`)
                ADAPTERS[family] = cls()
        return cls

    return wrap


def find_adapter(module: nn.Module) -> Adapter | None:
    """The adapter for `module`'s class or its nearest registered base class that takes it, or None."""
    for cls in type(module).__mro__:
        if cls in ADAPTERS and ADAPTERS[cls].matches(module):
            return ADAPTERS[cls]
    return None


def adapter_named(family: str) -> Adapter:
    """The adapter whose `family` is `family` (as recorded in a LayerPlan)."""
    return next(adapter for adapter in ADAPTERS.values() if adapter.family == family)


@register_adapter(Mlp)
class MlpAdapter(Adapter):
    """timm `Mlp`: fc1 -> act -> drop -> norm -> fc2 -> drop (Linear, or 1x1 Conv2d with use_conv)."""

    family = "Mlp"

    def options(self, ffn: Mlp) -> dict:
        return _options(ffn, ffn.fc1, ffn.norm, "layernorm", drop=(ffn.drop1.p, ffn.drop2.p))


@register_adapter(GlobalResponseNormMlp)
class GlobalResponseNormMlpAdapter(Adapter):
    """timm `GlobalResponseNormMlp` (ConvNeXt-V2): fc1 -> act -> drop -> GRN -> fc2 -> drop."""

    family = "GlobalResponseNormMlp"

    def options(self, ffn: GlobalResponseNormMlp) -> dict:
        return _options(ffn, ffn.fc1, ffn.grn, "grn", drop=(ffn.drop1.p, ffn.drop2.p))

    def expert_state(self, dense: dict[str, torch.Tensor], units: torch.Tensor) -> dict[str, torch.Tensor]:
        return _plain_state(dense, units, norm="grn")


@register_adapter(ConvMlp)
class ConvMlpAdapter(Adapter):
    """timm `ConvMlp`: 1x1 conv fc1 -> norm -> act -> drop -> 1x1 conv fc2, on [B, C, H, W]."""

    family = "ConvMlp"

    def options(self, ffn: ConvMlp) -> dict:
        return _options(ffn, ffn.fc1, ffn.norm, "layernorm_before_act", drop=(ffn.drop.p, 0.0))


@register_adapter(GluMlp)
class GluMlpAdapter(Adapter):
    """timm `GluMlp` / `SwiGLUPacked`: fc1 -> chunk (x1, x2) -> x1 * act(x2) (or act(x1) * x2) -> norm -> fc2."""

    family = "GluMlp"

    def options(self, ffn: GluMlp) -> dict:
        glu = "act_last" if ffn.gate_last else "act_first"
        return _options(ffn, ffn.fc1, ffn.norm, "layernorm", drop=(ffn.drop1.p, ffn.drop2.p), glu=glu)

    def expert_state(self, dense: dict[str, torch.Tensor], units: torch.Tensor) -> dict[str, torch.Tensor]:
        half = _matrix(dense["fc1.weight"]).shape[0] // 2
        rows = torch.cat([units, units + half])  # the same hidden units in both halves
        state = _plain_state({k: v for k, v in dense.items() if not k.startswith("fc1.")}, units, norm="norm")
        state["fc1.weight"] = _matrix(dense["fc1.weight"])[rows]
        if "fc1.bias" in dense:
            state["fc1.bias"] = dense["fc1.bias"][rows]
        return state


@register_adapter(SwiGLU)
class SwiGLUAdapter(Adapter):
    """timm `SwiGLU`: act(fc1_g(x)) * fc1_x(x) -> norm -> fc2. The experts fuse fc1_g and fc1_x into one fc1."""

    family = "SwiGLU"

    def shape(self, ffn: SwiGLU) -> FFNShape:
        return FFNShape(self.family, _in(ffn.fc1_g), _in(ffn.fc2), _out(ffn.fc2), -1)

    def options(self, ffn: SwiGLU) -> dict:
        return _options(ffn, ffn.fc1_g, ffn.norm, "layernorm", drop=(ffn.drop1.p, ffn.drop2.p), glu="act_first")

    def expert_state(self, dense: dict[str, torch.Tensor], units: torch.Tensor) -> dict[str, torch.Tensor]:
        state = _plain_state({k: v for k, v in dense.items() if not k.startswith("fc1_")}, units, norm="norm")
        state["fc1.weight"] = torch.cat([dense["fc1_g.weight"][units], dense["fc1_x.weight"][units]])
        if "fc1_g.bias" in dense:
            state["fc1.bias"] = torch.cat([dense["fc1_g.bias"][units], dense["fc1_x.bias"][units]])
        return state


def _options(ffn: nn.Module, fc1: nn.Module, norm: nn.Module, norm_kind: str, *, drop: tuple[float, float],
             glu: str | None = None) -> dict:
    """`Experts` options for an FFN whose first projection is `fc1` and inner norm module is `norm`."""
    if isinstance(norm, GlobalResponseNorm):
        inner = "grn"
    else:
        inner = _inner_norm(norm, norm_kind, type(ffn).__name__)
    return {
        "glu": glu,
        "inner_norm": inner,
        "norm_eps": getattr(norm, "eps", 1e-6),
        "bias": (fc1.bias is not None, ffn.fc2.bias is not None),
        "drop": drop,
    }


def _in(layer: nn.Module) -> int:
    return layer.in_features if isinstance(layer, nn.Linear) else layer.in_channels


def _out(layer: nn.Module) -> int:
    return layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels


def _matrix(weight: torch.Tensor) -> torch.Tensor:
    """A Linear weight, or a 1x1 conv weight [out, in, 1, 1] as [out, in]."""
    return weight.reshape(weight.shape[0], -1)


def _plain_state(dense: dict[str, torch.Tensor], units: torch.Tensor, norm: str) -> dict[str, torch.Tensor]:
    """fc1 rows, inner-norm entries and fc2 columns of the hidden units `units`; biases of fc2 whole."""
    state: dict[str, torch.Tensor] = {}
    if "fc1.weight" in dense:
        state["fc1.weight"] = _matrix(dense["fc1.weight"])[units]
    if "fc1.bias" in dense:
        state["fc1.bias"] = dense["fc1.bias"][units]
    for name in ("weight", "bias"):
        if f"{norm}.{name}" in dense:
            state[f"norm.{name}"] = dense[f"{norm}.{name}"][units]
    state["fc2.weight"] = _matrix(dense["fc2.weight"])[:, units]
    if "fc2.bias" in dense:
        state["fc2.bias"] = dense["fc2.bias"]
    return state


def _inner_norm(norm: nn.Module, as_kind: str, family: str) -> str:
    """Map the FFN's inner norm module to an `Experts` inner-norm kind, or refuse clearly."""
    if isinstance(norm, nn.Identity):
        return "none"
    if isinstance(norm, nn.LayerNorm) and norm.elementwise_affine:
        return as_kind
    raise MoespecError(
        f"the {family} FFN has an inner norm of type {type(norm).__name__}, which moespec experts do not "
        f"support yet; supported: none (Identity) or an affine LayerNorm"
    )


__all__ = ["ADAPTERS", "Adapter", "FFNShape", "adapter_named", "find_adapter", "register_adapter"]

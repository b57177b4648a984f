"""The experts' activation vocabulary, owned by the default path (`bias_act`) and read by the triton step
(`scattered`): the activations the fused ops compute, the GLU orders, and which of them an activation module is."""

from __future__ import annotations

from typing import Literal

import torch

GluOrder = Literal["act_first", "act_last"]  # act(a) * b (SwiGLU)  |  a * act(b) (timm GluMlp default)
ACTIVATIONS = ("gelu", "silu")  # GELU with erf (timm's nn.GELU, F.gelu's default), x * sigmoid(x)
GLU_ORDERS = (None, "act_first", "act_last")  # plain, act(a) * b (SwiGLU), a * act(b): the ops take the index


def activation(act: torch.nn.Module) -> str | None:
    """The ops' name for the activation module `act` ("gelu", "silu"), or None if they have none for it."""
    if isinstance(act, torch.nn.GELU):
        return "gelu" if act.approximate == "none" else None
    if isinstance(act, torch.nn.SiLU):
        return "silu"
    if type(act).__module__.startswith("timm."):  # timm's own modules: F.gelu, x * sigmoid(x)
        return {"GELU": "gelu", "Swish": "silu"}.get(type(act).__name__)
    return None

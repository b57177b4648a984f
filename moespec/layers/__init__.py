"""The nn.Modules moespec inserts. They take plain numbers and sub-modules, never a spec."""

from .experts import Experts, StackedLinear, StackedNorm
from .moe import MoE
from .rescale import Rescale, RescaledBlock, rescaled
from .routers import ExpertChoiceRouter, ImageRouter, LinearGate, ProjectedGate, TopKRouter
from .routing import AUX_LOSSES, Routing, register_aux_loss
from .soft import SoftMoE

MOE_LAYERS = (MoE, SoftMoE)
"""Every layer class moespec puts where a dense FFN was."""

__all__ = ["AUX_LOSSES", "ExpertChoiceRouter", "Experts", "ImageRouter", "LinearGate", "MOE_LAYERS", "MoE",
           "ProjectedGate", "Rescale", "RescaledBlock", "Routing", "SoftMoE", "StackedLinear", "StackedNorm",
           "TopKRouter", "register_aux_loss", "rescaled"]

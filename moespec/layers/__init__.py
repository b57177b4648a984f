"""The nn.Modules moespec inserts. They take plain numbers and sub-modules, never a spec. (`bias_steps`: when the
balancing biases move, `moespec.update_bias` and the step after every optimizer step.)"""

from .experts import Experts, StackedLinear, StackedNorm
from .gates import BalancingBias, LinearGate, ProjectedGate
from .image_ffn import FFNCopies, ImageFFNMoE
from .interfaces import MoELayer, Router
from .moe import MoE
from .rescale import Rescale, RescaledBlock, rescaled
from .routers import ExpertChoiceRouter, ImageRouter, TopKRouter
from .routing import AUX_LOSSES, Routing, register_aux_loss
from .soft import SoftMoE
from .steps import EXPERT_STEPS, set_expert_step

__all__ = ["AUX_LOSSES", "EXPERT_STEPS", "BalancingBias", "ExpertChoiceRouter", "Experts", "FFNCopies", "ImageFFNMoE",
           "ImageRouter", "LinearGate", "MoE", "MoELayer", "ProjectedGate", "Rescale", "RescaledBlock", "Router",
           "Routing", "SoftMoE", "StackedLinear", "StackedNorm", "TopKRouter", "register_aux_loss", "rescaled",
           "set_expert_step"]

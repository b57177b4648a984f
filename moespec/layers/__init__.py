"""The nn.Modules moespec inserts, and the tiers below them. The modules take plain numbers and sub-modules, never
a spec; a newcomer reads them first and may skip the rest.

    layers/           the modules: MoE (moe.py), SoftMoE (soft.py), ImageFFNMoE (image_ffn.py), Experts (the
                      stacked bank, experts.py), routers and gates, what routing decides (routing.py), the two
                      interfaces (interfaces.py), rescale, when the balancing biases move (balancing.py)
    layers/steps/     the expert steps as one table, the chooser and its rule, the routed-rows record, the
                      transport (this process, or all-to-all over ranks)
    layers/ops/       torch ops, each with its torch fallback; how a call runs (`ops.mode.Mode`), decided once
    layers/kernels/   Triton kernels and their launchers only (the one folder that imports Triton)

A tier imports only the tiers below it (tests/test_house.py).
"""

from .experts import Experts, StackedLinear, StackedNorm
from .gates import BalancingBias, LinearGate, ProjectedGate
from .image_ffn import FFNCopies, ImageFFNMoE
from .interfaces import MoELayer, Router
from .moe import MoE
from .ops.mode import Mode, device_path
from .rescale import Rescale, RescaledBlock, rescaled
from .routers import ExpertChoiceRouter, ImageRouter, TopKRouter
from .routing import AUX_LOSSES, Routing, register_aux_loss
from .soft import SoftMoE
from .steps import EXPERT_STEPS, available_steps, set_expert_step

__all__ = ["AUX_LOSSES", "EXPERT_STEPS", "BalancingBias", "ExpertChoiceRouter", "Experts", "FFNCopies", "ImageFFNMoE",
           "ImageRouter", "LinearGate", "MoE", "MoELayer", "Mode", "ProjectedGate", "Rescale", "RescaledBlock",
           "Router", "Routing", "SoftMoE", "StackedLinear", "StackedNorm", "TopKRouter", "available_steps",
           "device_path", "register_aux_loss", "rescaled", "set_expert_step"]

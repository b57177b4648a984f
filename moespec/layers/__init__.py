"""The nn.Modules moespec inserts. They take plain numbers and sub-modules, never a spec."""

from .experts import Experts, StackedLinear, StackedNorm
from .moe import MoE
from .routers import AUX_LOSSES, ROUTERS, Routing, TopKRouter

__all__ = ["AUX_LOSSES", "Experts", "MoE", "ROUTERS", "Routing", "StackedLinear", "StackedNorm", "TopKRouter"]

"""moespec: declarative Mixture-of-Experts surgery for timm vision models.

    spec.yaml -> load_spec -> plan -> create_model (fx rewrite) -> upcycle -> stats / save
"""

__version__ = "0.1.0"

from .checkpoint import load, save
from .compile import create_model, moe_layers
from .errors import CheckpointError, MoespecError, SpecError
from .layers.moe import aux_loss
from .plan import Plan, plan
from .spec import Spec, load_spec
from .stats import stats
from .timm_registry import register_timm
from .upcycle import upcycle, upcycle_to_checkpoint

__all__ = [
    "CheckpointError", "MoespecError", "Plan", "Spec", "SpecError", "aux_loss", "create_model", "load",
    "load_spec", "moe_layers", "plan", "register_timm", "save", "stats", "upcycle", "upcycle_to_checkpoint",
]

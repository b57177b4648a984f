"""moespec: declarative Mixture-of-Experts surgery for timm vision models.

    spec.yaml -> load_spec -> plan -> create_model (fx rewrite) -> upcycle -> stats / save

One subpackage per stage, in dependency order: `spec`, `backbones`, `planning`, `compiler`, `io`, `weights`,
`counting`, `apps`; `layers` holds the modules, `routers` one file per router kind.
"""

from . import routers  # noqa: F401  (registers the built-in router kinds before any spec is validated)
from ._version import __version__ as __version__  # re-exported: moespec.__version__
from .apps.timm_registry import register_timm
from .compiler import create_model, moe_layers
from .counting import stats
from .errors import CheckpointError, MoespecError, SpecError
from .layers.moe import aux_loss, follow_grad_scaler
from .planning import Plan, plan
from .spec import Spec, load_spec
from .weights import load, save, upcycle, upcycle_to_checkpoint

__all__ = [
    "CheckpointError", "MoespecError", "Plan", "Spec", "SpecError", "aux_loss", "create_model", "follow_grad_scaler",
    "load", "load_spec", "moe_layers", "plan", "register_timm", "save", "stats", "upcycle", "upcycle_to_checkpoint",
]

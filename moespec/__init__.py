"""moespec: declarative Mixture-of-Experts surgery for timm vision models.

    spec.yaml -> load_spec -> plan -> create_model (fx rewrite) -> upcycle -> stats / save
"""

__version__ = "0.1.0"

from .compile import create_model
from .errors import CheckpointError, MoespecError, SpecError
from .plan import Plan, plan
from .spec import Spec, load_spec

__all__ = ["CheckpointError", "MoespecError", "Plan", "Spec", "SpecError", "create_model", "load_spec", "plan"]

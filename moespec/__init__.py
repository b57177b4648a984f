"""moespec: declarative Mixture-of-Experts surgery for timm vision models.

    spec.yaml -> load_spec -> plan -> create_model (fx rewrite) -> upcycle -> stats / save

One subpackage per stage, in dependency order: `spec`, `backbones`, `planning`, `compiler`, `io`, `weights`,
`counting`, `compress` (prune, merge, densify a trained model), `apps`; `layers` holds the modules, `routers` one
file per router kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import routers  # noqa: F401  (registers the built-in router kinds before any spec is validated; no torch)
from ._version import __version__ as __version__  # re-exported: moespec.__version__
from .apps import timm_hook
from .errors import CheckpointError, MoespecError, SpecError
from .lazy import lazy_names
from .planning import Plan, plan
from .spec import Spec, load_spec

# `plan` imports torch and timm only when it builds a backbone. The rest of the public API imports them: seconds
# that `moespec --help`, `moespec schema` and reading a spec should not pay. It is imported on first use (PEP 562:
# `__getattr__` below), so `from moespec import create_model` works as before; type checkers and IDEs see the
# names through the TYPE_CHECKING imports.
if TYPE_CHECKING:
    from .apps.hub_folder import save_for_hf
    from .apps.optimizer import optimizer_groups
    from .apps.timm_registry import register_timm
    from .compiler import create_model, moe_layers, plan_of
    from .compress import densify, merge, prune
    from .counting import fvcore_handles, stats
    from .layers.balancing import update_bias, update_bias_on_step
    from .layers.moe import aux_loss, follow_grad_scaler
    from .layers.steps import set_expert_step
    from .weights import load, save, upcycle, upcycle_to_checkpoint
    from .weights.vmoe import import_vmoe

_LAZY = {
    "optimizer_groups": "apps.optimizer", "register_timm": "apps.timm_registry", "save_for_hf": "apps.hub_folder",
    "create_model": "compiler", "moe_layers": "compiler", "plan_of": "compiler",
    "densify": "compress", "merge": "compress", "prune": "compress",
    "fvcore_handles": "counting", "stats": "counting",
    "aux_loss": "layers.moe", "follow_grad_scaler": "layers.moe", "update_bias": "layers.balancing",
    "update_bias_on_step": "layers.balancing", "set_expert_step": "layers.steps", "load": "weights", "save": "weights",
    "upcycle": "weights", "upcycle_to_checkpoint": "weights", "import_vmoe": "weights.vmoe",
}
"""Public name -> the subpackage (relative to moespec) that defines it."""

timm_hook.install()  # timm.create_model("local-dir:FOLDER") of a moespec model, once timm is imported

__all__ = [
    "CheckpointError", "MoespecError", "Plan", "Spec", "SpecError", "aux_loss", "create_model", "densify",
    "follow_grad_scaler", "fvcore_handles", "import_vmoe", "load", "load_spec", "merge", "moe_layers",
    "optimizer_groups", "plan", "plan_of", "prune", "register_timm", "save", "save_for_hf", "set_expert_step", "stats",
    "update_bias", "update_bias_on_step", "upcycle", "upcycle_to_checkpoint",
]


__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY, __all__)

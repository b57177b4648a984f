"""Router kinds, one file each, every one a complete `spec.RouterSpec` subclass: its settings, and what the
later stages ask of it (the module it builds, its plan column, upcycling caveats, what an activated item is and
what `moespec inspect` counts). Importing this package registers the built-in kinds; a new kind is one more
file whose class is decorated with `register_router_kind` (README, "Extending").

Registering needs only pydantic: the built-in kinds import torch and `moespec.layers` inside the functions that
build modules or tally an inspection, so that validating YAML, `moespec schema` and `moespec --help` do not pay
the seconds torch takes to import.

    topk.py  token choice top-k     expert_choice.py  expert choice     image.py  image-level     soft.py  Soft MoE
    choice.py  the settings top-k and image-level routing share (top_k, DeepSeek-V3's options, eval_top_k)
    hash.py  the hash router (Roller et al. 2021), opt-in: the README's worked example of a new kind
"""

# Registration order is the order of the JSON Schema's `router:` oneOf.
from . import topk  # noqa: F401, I001
from . import expert_choice  # noqa: F401
from . import soft  # noqa: F401
from . import image  # noqa: F401
from .gates import TOKENS, Gate, GateField, RoutingGroup, build_gate, routed_pairs, sparse_moe

__all__ = ["TOKENS", "Gate", "GateField", "RoutingGroup", "build_gate", "routed_pairs", "sparse_moe"]

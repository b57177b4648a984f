"""Stage 6, weights: where a compiled model's weights come from and go to.

    dense.py       the dense backbone with its weights (checkpoint file, timm pretrained, fresh), checked
    mapping.py     the dense -> MoE state mapping: names copied as they are, FFNs cut out for the experts
    upcycle.py     experts copied from the dense FFN, in memory; caveats; the dense-vs-MoE check
    streaming.py   upcycling straight to a sharded checkpoint, one MoE layer at a time
    checkpoint.py  save / load: safetensors with the spec inside
"""

from ..choices import check_seed
from ..spec import SPEC_HASH_KEY, SPEC_KEY, VERSION_KEY, embedded_spec, spec_metadata
from .checkpoint import READ_ATTEMPTS, check_buffers, checked_weights, hub_weights, load, output_dtype, read_spec, save
from .dense import check_state_dict, dense_model, read_state_dict, refuse_non_finite, weight_cap
from .streaming import upcycle_to_checkpoint
from .upcycle import UpcycleReport, caveats, compare, upcycle, upcycle_into, upcycle_with_report

__all__ = ["READ_ATTEMPTS", "SPEC_HASH_KEY", "SPEC_KEY", "UpcycleReport", "VERSION_KEY", "caveats", "check_buffers",
           "check_seed", "check_state_dict", "checked_weights", "compare", "dense_model", "embedded_spec",
           "hub_weights", "load", "output_dtype", "read_spec", "read_state_dict", "refuse_non_finite", "save",
           "spec_metadata", "upcycle", "upcycle_into", "upcycle_to_checkpoint", "upcycle_with_report", "weight_cap"]

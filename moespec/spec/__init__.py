"""Stage 1, the spec: YAML to a validated, frozen `Spec`. No torch, no timm.

    fields.py     the base model and number types      registry.py   selectors, RouterSpec (a router kind)
    selectors.py  `where:` selectors                    blocks.py     BlockLayout, BackboneSketch: the backbone as data
    models.py     one pydantic model per YAML mapping   problems.py   pydantic errors -> located Problems
    loading.py    load_spec, spec_files, spec_problem   schema.py     the JSON Schema of spec files
    yaml_positions.py  YAML with file:line:col of values   yaml_limits.py  size, depth and alias budgets
    embedded.py   a spec inside a saved model: checkpoint metadata, a Hub folder's model_args
    hub_config.py a Hub folder's config.json, read field by field with located refusals
    compat.py     specs of the previous release (top_k and capacity_factor on the group) and `validate --fix`
"""

from .blocks import BackboneSketch, Block, BlockLayout, FFNShape, Rescalable
from .embedded import (
           HUB_ARCHITECTURE,
           HUB_SPEC_ARG,
           SPEC_HASH_KEY,
           SPEC_KEY,
           VERSION_KEY,
           embedded_spec,
           spec_metadata,
           spec_with_model_args,
)
from .fields import SpecModel
from .hub_config import (
           carried_spec,
           check_architecture,
           check_head,
           hub_config,
           hub_spec,
           load_model_spec,
           model_args_spec,
)
from .loading import HUB_CONFIG, is_hub_folder, load_spec, located, read_document, spec_files, spec_problem
from .models import DENSE_SUFFIXES, AuxLoss, Backbone, MoEGroup, RescaleSpec, Spec, Upcycle
from .problems import allowed_keys
from .registry import (
           ROUTER_KINDS,
           SELECTORS,
           FieldError,
           Inspection,
           RouterSpec,
           register_router_kind,
           register_selector,
           unregister_router_kind,
           unregister_selector,
)
from .schema import SCHEMA_FILE, json_schema, json_schema_text

__all__ = ["DENSE_SUFFIXES", "HUB_ARCHITECTURE", "HUB_CONFIG", "HUB_SPEC_ARG", "ROUTER_KINDS", "SPEC_HASH_KEY",
           "SPEC_KEY", "VERSION_KEY", "embedded_spec", "hub_config", "hub_spec", "is_hub_folder", "load_model_spec",
           "carried_spec", "check_architecture", "check_head", "model_args_spec",
           "spec_metadata",
           "spec_with_model_args", "SCHEMA_FILE", "SELECTORS", "AuxLoss", "Backbone", "BackboneSketch",
           "Block", "BlockLayout", "FieldError", "FFNShape", "Inspection", "MoEGroup", "RescaleSpec", "Rescalable",
           "RouterSpec", "Spec", "SpecModel", "Upcycle", "allowed_keys", "json_schema", "json_schema_text",
           "load_spec", "located", "read_document", "register_router_kind", "register_selector", "spec_files",
           "spec_problem", "unregister_router_kind", "unregister_selector"]

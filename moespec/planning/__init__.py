"""Stage 3, the plan: a `Spec` plus its dense timm model (read as a `spec.BackboneSketch`) give a frozen
`Plan` (which FFNs become MoE layers, at which widths, with which router), numbers only. The compiler and the
upcycler read nothing else.

    plan.py          Plan, LayerPlan, RescalePlan; plan(spec), plan_for(spec, model or sketch)
    checks.py        what only the real model can tell: the input size it takes, the dense checkpoint file, the
                     items each layer routes
    forward_cost.py  what one forward on the CPU can afford: MACs and peak live bytes, measured on the meta device
    cache.py         backbone sketches kept between CLI runs: a backbone seen before needs no torch, no timm
"""

from .cache import backbone_facts, cache_folder
from .checks import (
    INPUT_SIZE_ERRORS,
    checkpoint_problem,
    input_refusal,
    input_size_error,
    input_size_of,
    input_size_problem,
    items_problems,
    spec_input_size,
)
from .plan import LayerPlan, Plan, RescalePlan, plan, plan_file, plan_for

__all__ = ["INPUT_SIZE_ERRORS", "LayerPlan", "Plan", "RescalePlan", "backbone_facts", "cache_folder",
           "checkpoint_problem", "input_refusal", "input_size_error", "input_size_of", "input_size_problem",
           "items_problems", "plan", "plan_file", "plan_for", "spec_input_size"]

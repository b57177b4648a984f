"""Stage 3, the plan: a `Spec` plus its dense timm model give a frozen `Plan` (which FFNs become MoE layers,
at which widths, with which router), numbers only. The compiler and the upcycler read nothing else.

    plan.py    Plan, LayerPlan, RescalePlan; plan(spec), plan_for(spec, model)
    checks.py  what only the real model can tell: the input size it takes, the dense checkpoint file
"""

from .checks import INPUT_SIZE_ERRORS, checkpoint_problem, input_size_of, input_size_problem
from .plan import LayerPlan, Plan, RescalePlan, plan, plan_for

__all__ = ["INPUT_SIZE_ERRORS", "LayerPlan", "Plan", "RescalePlan", "checkpoint_problem", "input_size_of",
           "input_size_problem", "plan", "plan_for"]

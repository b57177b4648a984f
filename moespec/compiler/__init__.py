"""Stage 4, compile: trace the dense timm model with torch.fx and apply the plan.

    tracer.py  the one tracer (timm's notrace leaves; MoE layers are leaves)
    passes.py  replace_ffns, rescale_blocks: GraphModule -> GraphModule, each a checked module swap
    build.py   build_moe (adapter + router kind), materialize
    model.py   create_model, compile_model (the timm model, swapped), compile_graph (the fx rewrite), plan_of
"""

from .build import build_moe, materialize
from .model import NoWeightDecay, check_fits_in_memory, compile_graph, compile_model, create_model, moe_layers, plan_of
from .passes import replace_ffns, rescale_blocks
from .tracer import CompileError, MoETracer, trace

__all__ = ["CompileError", "MoETracer", "NoWeightDecay", "build_moe", "check_fits_in_memory", "compile_graph",
           "compile_model", "create_model", "materialize", "moe_layers", "plan_of", "replace_ffns", "rescale_blocks",
           "trace"]

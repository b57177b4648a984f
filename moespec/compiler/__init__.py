"""Stage 4, compile: trace the dense timm model with torch.fx and apply the plan.

    tracer.py  the one tracer (timm's notrace leaves; MoE layers are leaves)
    passes.py  replace_ffns, rescale_blocks: GraphModule -> GraphModule, each a checked module swap
    build.py   build_moe (adapter + router kind), materialize
    model.py   create_model, compile_model (the timm model, swapped), compile_graph (the fx rewrite)
"""

from .build import build_moe, materialize
from .model import check_fits_in_memory, compile_graph, compile_model, create_model, moe_layers
from .passes import replace_ffns, rescale_blocks
from .tracer import CompileError, MoETracer, trace

__all__ = ["CompileError", "MoETracer", "build_moe", "check_fits_in_memory", "compile_graph", "compile_model",
           "create_model", "materialize", "moe_layers", "replace_ffns", "rescale_blocks", "trace"]

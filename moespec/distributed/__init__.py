"""Expert parallelism on torch.distributed: a compiled model's experts spread over the ranks, the rest
replicated under DistributedDataParallel, and the numbers of one process on the whole batch.

    sharding.py    shard_experts: each rank keeps E/W experts of every MoE layer (transport: layers/steps/transport.py)
    grads.py       clip_grad_norm_ over every rank's experts
    checkpoint.py  load / upcycle: each rank builds and reads only its experts
    state.py       save_state / load_state: model + optimizer with DCP, atomic, resumable at any world size
"""

from .checkpoint import load, upcycle
from .grads import clip_grad_norm_
from .sharding import expert_banks, expert_group, expert_parameters, shard_experts
from .state import load_state, save_state

__all__ = ["clip_grad_norm_", "expert_banks", "expert_group", "expert_parameters", "load", "load_state", "save_state",
           "shard_experts", "upcycle"]

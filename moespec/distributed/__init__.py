"""Expert parallelism on torch.distributed: a compiled model's experts spread over the ranks, the rest
replicated under DistributedDataParallel, and the numbers of one process on the whole batch.

    sharding.py    shard_experts: each rank keeps E/W experts of every MoE layer (the bank: layers/expert_parallel.py)
    grads.py       clip_grad_norm_ over every rank's experts
    checkpoint.py  load / upcycle (each rank builds and reads only its experts), save_state / load_state (DCP)
"""

from .checkpoint import load, load_state, save_state, upcycle
from .grads import clip_grad_norm_
from .sharding import expert_banks, expert_group, expert_parameters, shard_experts

__all__ = ["clip_grad_norm_", "expert_banks", "expert_group", "expert_parameters", "load", "load_state", "save_state",
           "shard_experts", "upcycle"]

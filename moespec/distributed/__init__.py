"""Expert parallelism on torch.distributed: a compiled model's experts spread over the ranks, the rest
replicated under DistributedDataParallel, and the numbers of one process on the whole batch.

    parallel.py    parallelize: a (dp, ep) DeviceMesh laid out in one call, DDP or FSDP2 over dp, experts over ep
    sharding.py    shard_experts: each rank keeps E/W experts of every MoE layer (transport: layers/steps/transport.py)
    replicas.py    the experts' gradients averaged over their replicas (expert-parallel groups smaller than the world)
    wrapping.py    a fully_shard that would shard the experts twice, refused at the forward
    grads.py       clip_grad_norm_ over every rank's experts
    checkpoint.py  load / upcycle: each rank builds and reads only its experts
    state.py       save_state / load_state: model + optimizer with DCP, atomic, resumable at any world size
"""

from .checkpoint import load, upcycle
from .grads import clip_grad_norm_
from .parallel import parallelize
from .sharding import expert_banks, expert_group, expert_parameters, shard_experts
from .state import load_state, save_state

__all__ = ["clip_grad_norm_", "expert_banks", "expert_group", "expert_parameters", "load", "load_state",
           "parallelize", "save_state", "shard_experts", "upcycle"]

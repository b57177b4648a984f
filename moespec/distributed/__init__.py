"""Expert parallelism on torch.distributed: a compiled model's experts spread over the ranks, the rest
replicated under DistributedDataParallel, and the numbers of one process on the whole batch."""

from .grads import clip_grad_norm_
from .sharding import check_divisible, expert_group, expert_parameters, shard_experts

__all__ = ["check_divisible", "clip_grad_norm_", "expert_group", "expert_parameters", "shard_experts"]

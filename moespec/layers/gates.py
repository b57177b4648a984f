"""The routers' gates: item features [T, C] to expert logits [T, E], and DeepSeek-V3's balancing bias.

    LinearGate      logits = x W^T, the classic softmax gate
    ProjectedGate   cosine or L2 logits in a low-dimensional space, with a learnable temperature
    BalancingBias   a per-expert bias that steers the top-k choice toward balance, moved once per optimizer step
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import MoespecError


class LinearGate(nn.Module):
    """logits = W_g x (no bias)."""

    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    metric = "dot"  # what a row is compared with an item by: `point_at` and k-means follow it

    def router_weights(self) -> list[nn.Parameter]:
        """The weights upcycling draws afresh: all of them."""
        return [self.weight]

    def point_at(self, vectors: torch.Tensor) -> None:
        """Row i along `vectors[i]` ([E, C]), at the norm a N(0, 0.02^2) row has (0.02 sqrt(C)): the logits
        start at the scale of a fresh gate, and an item's largest logit is the row it points most along.
        mergekit's `hidden` gates are the unit directions; the scale is the init's, so the gate's softmax is
        no sharper than at a random start."""
        directions = F.normalize(vectors.to(self.weight.dtype), dim=-1)
        self.weight.copy_(directions * 0.02 * math.sqrt(self.weight.shape[1]))

    def macs_per_item(self) -> int:
        return self.weight.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ProjectedGate(nn.Module):
    """Cosine or L2 gate (Chi et al. 2022): project x to `proj_dim`, compare with learned expert codes.

    cosine: logits = cos(W_p x, e_i) / temperature;  l2: logits = -||W_p x - e_i|| / temperature.

    With `learnable_temperature` the temperature is a parameter, as in Swin-MoE (Hwang et al. 2023, through
    Tutel's `CosineTopKGate`, microsoft/tutel `tutel/gates/cosine_top.py`): the gate learns
    `log_scale = log(1 / temperature)`, starting at `temperature` (Tutel's `init_t` is 0.5), and multiplies the
    logits by `exp(min(log_scale, log(1 / 0.01)))`, so the temperature never falls below 0.01.
    """

    def __init__(self, dim: int, num_experts: int, proj_dim: int = 16, temperature: float = 0.07,
                 metric: str = "cosine", learnable_temperature: bool = False):
        super().__init__()
        self.metric, self.temperature = metric, temperature
        self.proj = nn.Linear(dim, proj_dim, bias=False)
        self.weight = nn.Parameter(torch.empty(num_experts, proj_dim))  # expert codes
        self.log_scale = nn.Parameter(torch.empty(())) if learnable_temperature else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.normal_(self.weight, std=0.02)
        if self.log_scale is not None:
            nn.init.constant_(self.log_scale, math.log(1.0 / self.temperature))

    def router_weights(self) -> list[nn.Parameter]:
        """The projection and the expert codes, which upcycling draws afresh; a learnable temperature keeps its
        initial value."""
        return [self.proj.weight, self.weight]

    def point_at(self, vectors: torch.Tensor) -> None:
        """Code i at the projection of `vectors[i]` ([E, C]): the item whose projection is nearest (l2) or most
        aligned (cosine) to it is routed to expert i. The projection keeps its random start."""
        self.weight.copy_(self.proj(vectors.to(self.weight.dtype)))

    def macs_per_item(self) -> int:
        return self.proj.weight.numel() + self.weight.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(x)
        if self.metric == "cosine":
            similarity = F.linear(F.normalize(z, dim=-1), F.normalize(self.weight, dim=-1))
        else:
            similarity = -torch.cdist(z.float(), self.weight.float()).to(z.dtype)
        if self.log_scale is None:
            return similarity / self.temperature
        return similarity * self.log_scale.clamp(max=LOG_MAX_LOGIT_SCALE).exp()


LOG_MAX_LOGIT_SCALE = math.log(1.0 / 0.01)
"""A learnable temperature's clamp: at least 0.01, i.e. a logit scale of at most 100 (Tutel's `clamp_max`)."""


class BalancingBias(nn.Module):
    """DeepSeek-V3's auxiliary-loss-free load balancing (DeepSeek-AI 2024; Wang et al. 2024) of one router: a bias
    per expert, `expert_bias` [E], added to the scores only to choose the top k in training, and the choices of
    the training forwards since the last step, `tokens_per_expert` [E]. Both are buffers, not parameters; only
    the bias is saved in checkpoints. `step` moves the bias once per optimizer step (`moespec.update_bias`)."""

    def __init__(self, num_experts: int, rate: float):
        super().__init__()
        self.rate = rate
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        # integers: exact at any count, and left alone by `model.to(dtype)` (a bfloat16 count stops at 256)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.long), persistent=False)
        self.forwards = 0  # training forwards since the last step (`balancing.BiasOnStep` warns past a bound)
        self.by_loop = False  # stepped by the loop (`update_bias`), not after each optimizer step (`BIAS_ON_STEP`)

    def init_non_persistent_buffers(self) -> None:
        """No choices counted yet. timm's and transformers' name: transformers builds a model on the meta device
        and calls this where a module has it, since a buffer that no checkpoint holds comes out of that build
        uninitialized (`TimmWrapperPreTrainedModel._init_weights`); garbage counts would move the first step's
        bias."""
        self.tokens_per_expert.zero_()
        self.forwards = 0

    @torch.no_grad()
    def count(self, experts: torch.Tensor) -> None:
        """Add the choices `experts` (any shape) to this step's loads."""
        chosen = experts.reshape(-1)
        self.tokens_per_expert.index_add_(0, chosen, torch.ones_like(chosen))

    @torch.no_grad()
    def step(self, load: torch.Tensor) -> None:
        """`expert_bias += rate * sign(mean load - load_e)` for the loads `load` [E] of one optimizer step (this
        module's `tokens_per_expert`, summed over the ranks that share the experts), then the count starts
        again. A step without choices changes nothing."""
        load = load.double()
        if load.sum() > 0:
            bias = self.expert_bias + self.rate * torch.sign(load.mean() - load).to(self.expert_bias.dtype)
            if not bool(torch.isfinite(bias).all()):  # a bias set to NaN or Inf by hand, or grown past its dtype
                raise MoespecError(f"the balancing bias would hold {bias[~torch.isfinite(bias)][0].item()}; "
                                   f"update_bias writes only finite biases, and left it as it is")
            self.expert_bias.copy_(bias)
        self.tokens_per_expert.zero_()
        self.forwards = 0

    def extra_repr(self) -> str:
        return f"rate={self.rate:g}"

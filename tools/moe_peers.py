"""The MoE blocks a user would pick instead of moespec, built with moespec's weights, and their references.

Used by `tools/bench_moe.py --peers`. Each peer is built from one moespec layer's weights (the same router
weights always, the same expert weights where the structures match) and comes with a per-expert reference
computed by hand from those weights under the peer's own semantics, so that the benchmark checks every
output before it times it. A peer whose library is not installed (or has no such block) is skipped with a
note; `pip install -e ".[bench]"` brings them all. Each family is timed against its own dense FFN; the GELU
peer whose experts have no biases (mixture-of-experts) is timed against the same biased GELU MLP: at top-2 the
MLP's biases add 9d additions to the 16 d^2 multiply-adds of a token (under 0.2% at d = 384).

    family  implementation                        semantics (top-k weights)
    swiglu  moespec MoE, SwiGLU Experts            softmax, top-k, renormalized (as Mixtral)
            transformers MixtralSparseMoeBlock     softmax, top-k, renormalized
            transformers Qwen3MoeSparseMoeBlock    softmax, top-k, norm_topk_prob (its config default: off)
            torchtune MoE                          (only where the installed release has one)
    gelu    moespec MoE, GELU Experts              softmax, top-k (not renormalized)
            deepspeed.moe.layer.MoE, ep_size=1     GShard gating, dropless (`drop_tokens=False`), without
                                                   its random parts (`use_rts`, 2nd-expert sampling): top-1
                                                   keeps the softmax value, top-2 renormalizes
            mixture-of-experts MoE (Top2Gating)    softmax, top-2, renormalized (g / (g1 + g2 + 1e-9)); top-2 only.
                                                   Deterministic with second_policy 'all' (its default 'random'
                                                   samples the 2nd expert); dropless with capacity factor E, which
                                                   makes the capacity the whole sequence: every expert runs on every
                                                   position of every sequence (E / 2 times the routed rows), the
                                                   price of dropless in a capacity-shaped dispatch. Its experts have
                                                   no biases: moespec's weights without the biases go in, and the
                                                   reference leaves them out too
            st-moe-pytorch MoE (TopNGating)        softmax, top-n, renormalized; n >= 2 only (it asserts). Its
                                                   threshold policy routes to the n-th expert with probability
                                                   min(1, g_n / threshold): threshold 0 (clamped to 1e-9) routes
                                                   always, so a gate is random only where it weighs below 1e-9.
                                                   Dropless with capacity factor E, as above. It takes any expert
                                                   modules: timm-Mlp-shaped GELU experts with moespec's weights (its
                                                   own default is a GEGLU expert of width 8d / 3, multiplicative bias)
    soft    moespec SoftMoE                        l2-normalized logits times a learned scale, raw slot inputs
            soft-moe-pytorch SoftMoE               RMS-normalized tokens and slot embeddings, normalized inputs
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from timm.layers import Mlp, SwiGLU
from torch import nn

from moespec.layers import Experts, LinearGate, MoE, SoftMoE, TopKRouter

DIM, HIDDEN = 384, 1536  # ViT-S width and its 4x FFN


@dataclass
class Peer:
    """One implementation: its family (which dense FFN it is compared with), the module, and the reference
    output for an input (None for the dense baseline, which is not checked)."""

    name: str
    family: str
    module: nn.Module
    reference: Callable[[torch.Tensor], torch.Tensor] | None


@dataclass
class Skipped:
    name: str
    reason: str


def bank(family: str, experts: int) -> Experts:
    """moespec's expert bank of a family: SwiGLU (no biases, act(a) * b) or GELU MLP."""
    if family == "swiglu":
        return Experts(experts, DIM, HIDDEN, DIM, act=nn.SiLU(), glu="act_first", bias=(False, False))
    return Experts(experts, DIM, HIDDEN, DIM, act=nn.GELU())


def dense(family: str, hidden: int) -> nn.Module:
    """The family's dense FFN of hidden width `hidden` (k * HIDDEN for equal activated FLOPs)."""
    if family == "swiglu":
        return SwiGLU(DIM, hidden, bias=False)
    return Mlp(DIM, hidden)


def expert_fn(experts: Experts, biases: bool = True) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """Expert e of a moespec bank on rows x [S, C], by hand from its stacked weights; `biases=False` leaves the
    bank's biases out (for a peer whose experts have none)."""
    fc1, fc2 = experts.fc1, experts.fc2
    bias1, bias2 = (fc1.bias, fc2.bias) if biases else (None, None)

    def run(e: int, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, fc1.weight[e], None if bias1 is None else bias1[e])
        if experts.glu:
            a, b = h.chunk(2, dim=-1)
            h = F.silu(a) * b
        else:
            h = F.gelu(h)
        return F.linear(h, fc2.weight[e], None if bias2 is None else bias2[e])

    return run


def topk_reference(gate_weight: torch.Tensor, top_k: int, normalize: bool, experts: Experts, biases: bool = True):
    """Token choice top-k, dropless, computed expert by expert: y_t = sum_j w_tj * expert_{e_tj}(x_t)."""
    run = expert_fn(experts, biases)

    def reference(x: torch.Tensor) -> torch.Tensor:
        items = x.reshape(-1, x.shape[-1])
        weights, chosen = F.linear(items, gate_weight).float().softmax(-1).topk(top_k, dim=-1)
        if normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(items)
        for e in range(gate_weight.shape[0]):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, weights[token, slot, None] * run(e, items[token]))
        return out.reshape(x.shape)

    return reference


def topk_peers(family: str, experts: int, top_k: int) -> tuple[list[Peer], list[Skipped]]:
    """moespec and the peers of one family at E experts and top-k, all with one set of weights."""
    torch.manual_seed(0)
    normalize = family == "swiglu"  # Mixtral's semantics for the SwiGLU family; plain softmax values for GELU
    layer = MoE(TopKRouter(LinearGate(DIM, experts), experts, top_k, normalize=normalize), bank(family, experts))
    gate = layer.router.gate.weight
    peers = [Peer(f"moespec {family}", family, layer, topk_reference(gate, top_k, normalize, layer.experts)),
             Peer(f"dense {family}", family, dense(family, top_k * HIDDEN), None)]
    skipped = []
    builders = (
        [("transformers mixtral", _mixtral), ("transformers mixtral eager", _mixtral_eager),
         ("transformers qwen3-moe", _qwen3), ("torchtune", _torchtune)]
        if family == "swiglu"
        else [("deepspeed", _deepspeed), ("mixture-of-experts", _mixture_of_experts), ("st-moe-pytorch", _st_moe)]
    )
    for name, build in builders:
        try:
            module, reference = build(layer, experts, top_k)
        except _Missing as missing:
            skipped.append(Skipped(name, str(missing)))
            continue
        peers.append(Peer(name, family, module, reference))
    return peers, skipped


class _Missing(Exception):
    """A peer that cannot be built here: its library is not installed, or has no such block."""


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise _Missing(f"{module} is not installed (pip install -e '.[bench]')")


def _transformers(kind: str, layer: MoE, experts: int, top_k: int, implementation: str):
    """transformers' sparse block of `kind` with the layer's gate and SwiGLU experts. `grouped_mm` is what a
    model gets by default (`get_correct_experts_implementation(None)`); a standalone block without it falls
    back to the per-expert `eager` loop."""
    _need("transformers")
    if kind == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        config = MixtralConfig(hidden_size=DIM, intermediate_size=HIDDEN, num_local_experts=experts,
                               num_experts_per_tok=top_k, experts_implementation=implementation)
        normalize = True
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        config = Qwen3MoeConfig(hidden_size=DIM, moe_intermediate_size=HIDDEN, num_experts=experts,
                                num_experts_per_tok=top_k, experts_implementation=implementation)
        normalize = config.norm_topk_prob
    block = Block(config)
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.gate.weight)
        block.experts.gate_up_proj.copy_(layer.experts.fc1.weight)  # [E, 2H, C]: the gate half first, as act_first
        block.experts.down_proj.copy_(layer.experts.fc2.weight)  # [E, C, H]
    return block, topk_reference(layer.router.gate.weight, top_k, normalize, layer.experts)


def _mixtral(layer, experts, top_k):
    return _transformers("mixtral", layer, experts, top_k, "grouped_mm")


def _mixtral_eager(layer, experts, top_k):
    return _transformers("mixtral", layer, experts, top_k, "eager")


def _qwen3(layer, experts, top_k):
    return _transformers("qwen3", layer, experts, top_k, "grouped_mm")


def _torchtune(layer, experts, top_k):
    """Read from the installed files, not by import: torchtune's __init__ needs torchao."""
    _need("torchtune")
    files = importlib.metadata.files("torchtune") or []
    if not any(str(f).startswith("torchtune/modules/moe/") for f in files):
        version = importlib.metadata.version("torchtune")
        raise _Missing(f"torchtune {version} (the installed release) has no torchtune.modules.moe")
    raise _Missing("torchtune.modules.moe is present but not wired here yet")


class _FirstOutput(nn.Module):
    """DeepSpeed's MoE returns (output, aux loss, expert counts), lucidrains' (output, losses...); the benchmark
    wants the output."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0]


def _deepspeed(layer, experts, top_k):
    """deepspeed.moe.layer.MoE at ep_size=1 (no process group needed) with timm-Mlp-shaped GELU experts."""
    _need("deepspeed")
    if top_k > 2:
        raise _Missing("DeepSpeed's top-k > 2 gating has no dropless mode")
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    moe = DeepSpeedMoE(DIM, nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)),
                       num_experts=experts, ep_size=1, k=top_k, drop_tokens=False, use_rts=False,
                       top2_2nd_expert_sampling=False)
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(layer.router.gate.weight)
        for e, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            expert[0].weight.copy_(layer.experts.fc1.weight[e])
            expert[0].bias.copy_(layer.experts.fc1.bias[e])
            expert[2].weight.copy_(layer.experts.fc2.weight[e])
            expert[2].bias.copy_(layer.experts.fc2.bias[e])
    return _FirstOutput(moe), topk_reference(layer.router.gate.weight, top_k, top_k == 2, layer.experts)


def _mixture_of_experts(layer, experts, top_k):
    """lucidrains' mixture-of-experts MoE (Top2Gating, GShard as in tensor2tensor), made deterministic (second
    policy 'all') and dropless (capacity factor E: the capacity is the sequence length), in train and eval mode
    alike. Its gate is a [C, E] matrix, its experts [E, C, H] and [E, H, C] without biases."""
    _need("mixture_of_experts")
    if top_k != 2:
        raise _Missing(f"mixture-of-experts gates top-2 only (Top2Gating), not top-{top_k}")
    from mixture_of_experts import MoE as LucidMoE

    moe = LucidMoE(DIM, num_experts=experts, hidden_dim=HIDDEN, activation=nn.GELU,
                   second_policy_train="all", second_policy_eval="all",
                   capacity_factor_train=float(experts), capacity_factor_eval=float(experts))
    with torch.no_grad():
        moe.gate.w_gating.copy_(layer.router.gate.weight.t())
        moe.experts.w1.copy_(layer.experts.fc1.weight.transpose(1, 2))
        moe.experts.w2.copy_(layer.experts.fc2.weight.transpose(1, 2))
    return _FirstOutput(moe), topk_reference(layer.router.gate.weight, 2, True, layer.experts, biases=False)


def _st_moe(layer, experts, top_k):
    """lucidrains' st-moe-pytorch MoE (TopNGating, ST-MoE's router z-loss) with threshold 0 (every one of the top
    n routed) and capacity factor E (dropless), in train and eval mode alike, on timm-Mlp-shaped GELU experts."""
    _need("st_moe_pytorch")
    if top_k < 2:
        raise _Missing(f"st-moe-pytorch's TopNGating needs top-n >= 2 (it asserts), not top-{top_k}")
    from st_moe_pytorch import MoE as StMoE

    bank = nn.ModuleList(nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
                         for _ in range(experts))
    moe = StMoE(DIM, num_experts=experts, gating_top_n=top_k, threshold_train=0.0, threshold_eval=0.0,
                capacity_factor_train=float(experts), capacity_factor_eval=float(experts), experts=bank,
                is_distributed=False)
    with torch.no_grad():
        moe.gate.to_gates.weight.copy_(layer.router.gate.weight)
        for e, expert in enumerate(moe.experts.experts):
            expert[0].weight.copy_(layer.experts.fc1.weight[e])
            expert[0].bias.copy_(layer.experts.fc1.bias[e])
            expert[2].weight.copy_(layer.experts.fc2.weight[e])
            expert[2].bias.copy_(layer.experts.fc2.bias[e])
    return _FirstOutput(moe), topk_reference(layer.router.gate.weight, top_k, True, layer.experts)


def soft_peers(experts: int, slots: int, tokens: int) -> tuple[list[Peer], list[Skipped]]:
    """Soft MoE with `slots` slots in all (slots / E per expert) on images of `tokens` tokens: moespec, the
    dense GELU MLP of equal expert FLOPs (hidden HIDDEN * slots / tokens), and soft-moe-pytorch."""
    torch.manual_seed(0)
    per_expert = slots // experts
    layer = SoftMoE(bank("gelu", experts), per_expert)
    peers = [Peer("moespec soft", "soft", layer, _moespec_soft_reference(layer)),
             Peer("dense soft", "soft", dense("gelu", round(HIDDEN * slots / tokens)), None)]
    if importlib.util.find_spec("soft_moe_pytorch") is None:
        return peers, [Skipped("soft-moe-pytorch", "soft_moe_pytorch is not installed (pip install -e '.[bench]')")]
    from soft_moe_pytorch import SoftMoE as LucidSoftMoE

    peer = LucidSoftMoE(DIM, num_experts=experts, num_slots=per_expert)
    with torch.no_grad():  # phi [C, n * p] -> slot embeddings [n, p, C]; experts: Linear, GELU, Dropout, Linear
        peer.slot_embeds.copy_(layer.phi.t().reshape(experts, per_expert, DIM))
        for e, expert in enumerate(peer.experts.experts):
            expert[0].weight.copy_(layer.experts.fc1.weight[e])
            expert[0].bias.copy_(layer.experts.fc1.bias[e])
            expert[3].weight.copy_(layer.experts.fc2.weight[e])
            expert[3].bias.copy_(layer.experts.fc2.bias[e])
    peers.append(Peer("soft-moe-pytorch", "soft", peer, _lucid_soft_reference(peer, layer.experts, per_expert)))
    return peers, []


def _soft_combine(inputs: torch.Tensor, logits: torch.Tensor, experts: Experts, per_expert: int) -> torch.Tensor:
    """Softmax over tokens to fill the slots from `inputs` [B, N, C], expert e on its slots, softmax over slots
    to combine. logits [B, N, S]."""
    run = expert_fn(experts)
    slots = torch.einsum("bns,bnc->bsc", logits.softmax(dim=1), inputs)
    outputs = torch.cat([run(e, slots[:, e * per_expert:(e + 1) * per_expert]) for e in range(experts.num_experts)],
                        dim=1)
    return torch.einsum("bns,bsc->bnc", logits.softmax(dim=-1), outputs)


def _moespec_soft_reference(layer: SoftMoE):
    """Puigcerver et al.: logits = l2norm(X) @ (scale * l2norm(Phi)), slots from the raw tokens."""

    def reference(x: torch.Tensor) -> torch.Tensor:
        logits = F.normalize(x, dim=-1) @ (layer.scale * F.normalize(layer.phi, dim=0))
        return _soft_combine(x, logits, layer.experts, layer.slots_per_expert)

    return reference


def _lucid_soft_reference(peer: nn.Module, experts: Experts, per_expert: int):
    """soft-moe-pytorch: RMSNorm (l2norm * sqrt(C) * gamma) on the tokens and the slot embeddings; the slots are
    filled from the normalized tokens."""

    def rms(t: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        return F.normalize(t, dim=-1) * math.sqrt(DIM) * gamma

    def reference(x: torch.Tensor) -> torch.Tensor:
        normed = rms(x, peer.norm.gamma)
        embeds = rms(peer.slot_embeds, peer.slot_norm.gamma).reshape(-1, DIM)  # [S, C]
        return _soft_combine(normed, normed @ embeds.t(), experts, per_expert)

    return reference

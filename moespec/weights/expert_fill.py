"""Filling one MoE layer's experts from dense FFN states (`upcycle_layer`): `Experts` banks, each expert cut from
its source FFN by the family's adapter (with Drop-Upcycling's re-initialized units and noise), or whole FFN
copies (`layers.ImageFFNMoE`), each its source's state dict."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import nn

from ..backbones import adapter_named
from ..planning import LayerPlan


def fill_banks(moe: nn.Module, layer: LayerPlan, ffns: Sequence[dict[str, torch.Tensor]],
                experts_from: Sequence[int], base_ffn: dict[str, torch.Tensor], options, generator: torch.Generator
                ) -> None:
    """The routed and shared `Experts` banks (each expert cut from its source FFN by the family's adapter), the
    banks' buffers and `pre`."""
    hidden = layer.expert_hidden
    adapter = adapter_named(layer.family)
    leading = torch.arange(hidden)
    units = [leading + (i * hidden if options.split == "partition" else 0) for i in range(layer.num_experts)]
    routed = [lambda u=u, ffn=ffns[source]: adapter.expert_state(ffn, u)
              for u, source in zip(units, experts_from, strict=True)]
    _fill(moe.experts, routed, options.noise, generator, drop=options.drop)
    if moe.shared is not None:
        shared = [lambda: adapter.expert_state(base_ffn, leading)] * layer.shared_experts
        _fill(moe.shared, shared, options.noise, generator)
    for bank in (moe.experts, moe.shared):
        for name, tensor in adapter.bank_buffers(base_ffn).items() if bank is not None else ():
            bank.get_buffer(name).copy_(tensor)
    if moe.pre is not None:
        moe.pre.load_state_dict(adapter.pre_state(base_ffn))


def copy_ffn(copy: nn.Module, state: dict[str, torch.Tensor], noise: float, generator: torch.Generator) -> None:
    """One whole FFN copy from the dense FFN's state dict, plus N(0, noise^2) on its weight matrices and kernels."""
    copy.load_state_dict(state)
    for name, param in copy.named_parameters():
        if noise > 0 and name.endswith("weight") and param.dim() >= 2:
            param.add_(torch.randn(param.shape, generator=generator), alpha=noise)


def _fill(bank: nn.Module, experts: list[Callable[[], dict[str, torch.Tensor]]], noise: float,
          generator: torch.Generator, drop: float = 0.0) -> None:
    """Copy each expert's tensors (made by `experts[i]()`, one expert at a time: a layer of a giant spec is
    large) into the bank's [E, ...] parameters, re-initializing a fraction `drop` of its hidden units
    (`drop_units`) and adding N(0, noise^2) to the fc weights. A bank sharded over ranks holds experts
    [first, first + local_experts): the others are not kept, but their random draws are made, so that the
    generator gives every rank the weights one process gives its experts."""
    params = dict(bank.named_parameters())
    first = getattr(bank, "first", 0)
    noisy = [name for name in params if noise > 0 and name.endswith("weight") and name.startswith("fc")]
    for i, make in enumerate(experts):
        local = i - first
        if not 0 <= local < bank.local_experts:
            if drop > 0:
                drop_units(make(), drop, generator)  # draws as the owning rank does
            for name in noisy:
                torch.randn(params[name].shape[1:], generator=generator)
            continue
        state = make()
        if drop > 0:
            state = drop_units(state, drop, generator)
        for name, tensor in state.items():
            params[name][local].copy_(tensor.reshape(params[name].shape[1:]))
        for name in noisy:
            params[name][local].add_(torch.randn(params[name].shape[1:], generator=generator), alpha=noise)


def drop_units(state: dict[str, torch.Tensor], fraction: float, generator: torch.Generator
               ) -> dict[str, torch.Tensor]:
    """Drop-Upcycling (Nakamura et al. 2025): `state`, one expert's tensors (`Adapter.expert_state` names), with
    floor(fraction x H) of its H hidden units, drawn at random, re-initialized: their fc1 rows (each half of a
    gated fc1 on its own), fc1 bias entries and fc2 columns are drawn from N(mean, std^2), the mean and std of
    the dense values they replace, tensor by tensor, as the paper's conversion script does. Inner-norm entries
    and fc2's bias are kept. Returns the new state; the chosen units are the first `floor(fraction x H)` of one
    `randperm(H)` draw."""
    hidden = state["fc2.weight"].shape[1]
    chosen = torch.randperm(hidden, generator=generator)[:math.floor(fraction * hidden + 1e-9)]
    state = dict(state)

    def redraw(name: str, dim: int, halves: int = 1) -> None:
        tensor = state[name].clone()
        for half in range(halves):
            index = chosen + half * hidden
            old = tensor.index_select(dim, index)
            std = old.std().item() if old.numel() > 1 else 0.0
            new = torch.randn(old.shape, generator=generator, dtype=torch.float32) * std + old.mean().item()
            tensor.index_copy_(dim, index, new.to(tensor.dtype))
        state[name] = tensor

    if "fc1.weight" in state:
        halves = state["fc1.weight"].shape[0] // hidden  # 2 for a gated fc1 ([gate; value] rows)
        redraw("fc1.weight", 0, halves)
        if "fc1.bias" in state:
            redraw("fc1.bias", 0, halves)
    redraw("fc2.weight", 1)
    return state

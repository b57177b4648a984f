"""Sparse upcycling (Komatsuzaki et al. 2023): start an MoE model from a dense one, in memory.

Every non-FFN weight is copied from the dense state dict; each expert (and shared expert) is a copy of the
dense FFN, or of a subset of its hidden units when experts are narrower (`split: slice` gives every expert
the leading units, `split: partition` gives expert i the i-th block); routers start N(0, 0.02^2) or zero.

Two ways, the same weights for the same seed:
    upcycle / upcycle_with_report   the whole MoE model in memory (to train it right away)
    upcycle_to_checkpoint           streams to (sharded) safetensors: the dense model plus one MoE layer at a
                                    time are in memory, never the whole MoE model (`streaming.py`)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..backbones import adapter_named
from ..compiler import create_model, moe_layers
from ..errors import SpecError
from ..planning import LayerPlan, Plan, items_problems, plan_for
from ..planning.forward_cost import refuse_costly_forward
from ..spec import RouterSpec, Spec, spec_problem
from .dense import dense_model
from .mapping import dense_to_moe


@dataclass(frozen=True)
class UpcycleReport:
    """How closely the upcycled model computes the dense function at initialization."""

    source: str  # where the dense weights came from
    max_abs_logit_diff: float
    max_abs_logit: float
    caveats: tuple[str, ...] = ()  # what in the spec changes the function, from `caveats(plan)`
    scope: str = "model"  # "model": logits of the whole model; "layers": each MoE layer against its dense FFN

    @property
    def function_preserving(self) -> bool:
        """Equal to the dense model up to fp32 rounding (1e-5, relative to the logit scale when it is > 1)."""
        return self.max_abs_logit_diff <= 1e-5 * max(1.0, self.max_abs_logit)

    def __str__(self) -> str:
        verdict = "yes" if self.function_preserving else "no"
        lines = [f"function-preserving: {verdict} (max |dlogit| = {self.max_abs_logit_diff:.3g})"]
        if self.scope == "layers":
            lines = [f"function-preserving: {verdict} (max |dy| = {self.max_abs_logit_diff:.3g} over the MoE layers, "
                     f"each against its dense FFN; the model, or a forward at its input size, is too large to compare "
                     f"whole)"]
        if self.max_abs_logit == 0:
            lines = ["function-preserving: cannot tell (the dense logits are all 0, e.g. a zero-initialized head; "
                     "upcycle trained weights to check)"]
        fresh = [c for c in self.caveats if "freshly initialized" in c]
        if not self.function_preserving:
            lines += [f"  because {caveat}" for caveat in self.caveats if caveat not in fresh]
        lines += [f"  {caveat}" for caveat in fresh]  # always said, block by block
        return "\n".join(lines)


def caveats(plan: Plan) -> tuple[str, ...]:
    """Why an upcycled model of `plan` may not compute the dense function, one line per surgery group and
    one per rebuilt block. The router kind says what its routing changes."""
    found: dict[str, None] = {}
    for r in plan.rescales:
        found[f"{r.block}: rebuilt at [{r.rescaled_tokens}, {r.rescaled_channels}] (rescale.{r.group}) and freshly "
              f"initialized; a block of a new shape cannot be upcycled"] = None
    for layer in plan.layers:
        if plan.rebuilt(layer.path) is not None:
            continue
        where = f"moe.{layer.group}"
        lines = [f"{layer.shared_experts} shared expert(s) add another copy of the dense FFN's output"
                 ] if layer.shared_experts else []
        lines += layer.router.caveats(layer)
        if layer.expert_hidden < layer.dense_hidden:
            lines.append(f"experts keep {layer.expert_hidden} of the dense FFN's {layer.dense_hidden} hidden units")
        if layer.family == "GlobalResponseNormMlp" and layer.router.picks() < layer.num_experts:
            lines.append("each GRN expert normalizes over only the positions it receives")
        found.update((f"{where}: {line}", None) for line in lines)
    return tuple(found)


def upcycle(spec: Spec, checkpoint: str | Path | None = None, *, seed: int = 0,
            trust_pickle: bool = False) -> nn.Module:
    """The MoE model of `spec` with every expert copied from the dense FFN (see `dense_model` for sources)."""
    model, _ = upcycle_with_report(spec, checkpoint, seed=seed, check=False, trust_pickle=trust_pickle)
    return model


def upcycle_with_report(spec: Spec, checkpoint: str | Path | None = None, *, seed: int = 0,
                        check: bool = True, trust_pickle: bool = False) -> tuple[nn.Module, UpcycleReport | None]:
    """`upcycle`, plus a comparison of the upcycled model's logits with the dense model's on random input."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # a dense model without weights gets a reproducible fresh init
        dense, source = dense_model(spec, checkpoint, trust_pickle=trust_pickle)
    generator = torch.Generator().manual_seed(seed)
    plan = plan_for(spec, dense)  # the plan `create_model` builds: the dense model is the spec's backbone
    check_items(spec, plan, dense)
    model = create_model(spec)
    upcycle_into(model, spec, plan, dense.state_dict(), generator)
    if not check:
        return model, None
    refuse_costly_forward(spec, plan.input_size, "checking the upcycled logits", batch=COMPARED_BATCH,
                          runner="a check", hint="use a smaller input size, or check=False")
    report = compare(dense, model, plan.input_size, source, generator)
    return model.train(), dataclasses.replace(report, caveats=caveats(plan))


@torch.no_grad()
def check_items(spec: Spec, plan: Plan, dense: nn.Module) -> None:
    """Each router's checks against the items per image its FFN receives (Soft MoE's identity routing needs one
    slot per token), from one forward of the dense model at batch 1: a located spec error before anything is
    built or written. FFNs of blocks that `rescale` rebuilds are not in the dense model and are not checked."""
    checked = [layer for layer in plan.layers if plan.rebuilt(layer.path) is None
               and type(layer.router).check_items is not RouterSpec.check_items]  # only routers that check
    if not checked:
        return
    refuse_costly_forward(spec, plan.input_size, "checking the items each router receives")
    items: dict[str, int] = {}

    def record(layer: LayerPlan, module: nn.Module, args: tuple) -> None:
        x = args[0]
        items[layer.path] = x.numel() // x.shape[layer.channels_dim]

    hooks = [dense.get_submodule(layer.path).register_forward_pre_hook(
        lambda module, args, layer=layer: record(layer, module, args)) for layer in checked]
    training = dense.training
    try:
        dense.eval()(torch.zeros(1, *plan.input_size))
    finally:
        dense.train(training)
        for hook in hooks:
            hook.remove()
    problems = items_problems(spec, plan.layers, items)
    if problems:
        raise SpecError(problems)


def upcycle_into(model: nn.Module, spec: Spec, plan: Plan, dense: dict[str, torch.Tensor],
                 generator: torch.Generator) -> None:
    """Copy `dense` into the compiled `model` in place: non-FFN weights as they are, FFNs into experts.
    Blocks rebuilt at a rescaled shape keep their fresh init: no dense weight has their shape."""
    plain, ffns = dense_to_moe(plan, dense)
    layers = moe_layers(model)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name in plain:
                tensor.copy_(plain[name])
        for path, ffn_state in ffns.items():
            upcycle_layer(layers[path], plan.layer(path), ffn_state, spec, generator)


def upcycle_layer(moe: nn.Module, layer: LayerPlan, ffn_state: dict[str, torch.Tensor], spec: Spec,
                   generator: torch.Generator) -> None:
    options = spec.upcycle
    hidden = layer.expert_hidden
    if hidden > layer.dense_hidden:
        width = "expert_hidden" if spec.moe[layer.group].expert_hidden is not None else "expert_mlp_ratio"
        raise SpecError(spec_problem(
            spec, f"moe.{layer.group}.{width}",
            f"{layer.path}: experts of {hidden} hidden units cannot be upcycled from a dense FFN of "
            f"{layer.dense_hidden}; use an expert width <= {layer.dense_hidden}"))
    if options.split == "partition" and hidden * layer.num_experts > layer.dense_hidden:
        raise SpecError(spec_problem(
            spec, "upcycle.split",
            f"{layer.path}: split: partition needs experts x expert_hidden <= {layer.dense_hidden} "
            f"(got {layer.num_experts} x {hidden}); use split: slice or narrower experts"))
    adapter = adapter_named(layer.family)
    leading = torch.arange(hidden)
    units = [leading + (i * hidden if options.split == "partition" else 0) for i in range(layer.num_experts)]
    _fill(moe.experts, [lambda u=u: adapter.expert_state(ffn_state, u) for u in units], options.noise, generator)
    if moe.shared is not None:
        shared = [lambda: adapter.expert_state(ffn_state, leading)] * layer.shared_experts
        _fill(moe.shared, shared, options.noise, generator)
    for bank in (moe.experts, moe.shared):
        for name, tensor in adapter.bank_buffers(ffn_state).items() if bank is not None else ():
            bank.get_buffer(name).copy_(tensor)
    if moe.pre is not None:
        moe.pre.load_state_dict(adapter.pre_state(ffn_state))
    for weight in moe.router_weights():
        if options.router_init == "zeros":
            weight.zero_()
        else:
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.02)


def _fill(bank: nn.Module, experts: list[Callable[[], dict[str, torch.Tensor]]], noise: float,
          generator: torch.Generator) -> None:
    """Copy each expert's tensors (made by `experts[i]()`, one expert at a time: a layer of a giant spec is
    large) into the bank's [E, ...] parameters, adding N(0, noise^2) to the fc weights. A bank sharded over
    ranks holds experts [first, first + local_experts): the others are not made, but their noise is drawn, so
    that the generator gives every rank the noise one process gives its experts."""
    params = dict(bank.named_parameters())
    first = getattr(bank, "first", 0)
    noisy = [name for name in params if noise > 0 and name.endswith("weight") and name.startswith("fc")]
    for i, make in enumerate(experts):
        local = i - first
        if not 0 <= local < bank.local_experts:
            for name in noisy:
                torch.randn(params[name].shape[1:], generator=generator)
            continue
        for name, tensor in make().items():
            params[name][local].copy_(tensor.reshape(params[name].shape[1:]))
        for name in noisy:
            params[name][local].add_(torch.randn(params[name].shape[1:], generator=generator), alpha=noise)


COMPARED_BATCH = 2  # random inputs the logit check runs through both models


@torch.no_grad()
def compare(dense: nn.Module, model: nn.Module, input_size: tuple[int, int, int], source: str,
            generator: torch.Generator, batch: int = COMPARED_BATCH) -> UpcycleReport:
    """Max |logit difference| between the dense and the MoE model on one random batch, in eval mode."""
    x = torch.randn((batch, *input_size), generator=generator)
    dense_logits = dense.eval()(x)
    moe_logits = model.eval()(x)
    diff = (dense_logits - moe_logits).abs().max().item()
    return UpcycleReport(source, diff, dense_logits.abs().max().item())

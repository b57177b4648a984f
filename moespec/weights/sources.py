"""The dense side of an upcycle from several checkpoints (mergekit-moe's clown car, for timm models): each
routed expert takes its FFN from one source, everything else comes from the base.

    sources     the checkpoints given, in order: source 0 is the first (one source: today's upcycle)
    experts     expert i of a layer takes source `experts_from[i]`, by default i mod (number of sources)
    base        everything outside the routed experts (attention, norms, head, shared experts, an FFN's own
                input module): source 0 (`base: first`), or the element-wise mean of all sources
                (`base: average`; a tensor a source keeps at its fresh init, a head for other classes, is left
                out of that source's share)

Each source is read and fitted to the spec's model as one checkpoint is (`dense_model`); only its FFN tensors
are kept, so memory is the base model plus every source's FFNs of the planned layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import torch
from torch import nn

from ..errors import CheckpointError, MoespecError, SpecError
from ..planning import LayerPlan, Plan, plan_for
from ..spec import Spec, spec_problem
from .dense import dense_model_and_fresh
from .mapping import dense_to_moe

Checkpoints = Union[str, Path, Sequence[Union[str, Path]], None]
"""What `upcycle` takes: one checkpoint, several (a list), or None for the spec's own dense source."""

FFNStates = dict[str, dict[str, torch.Tensor]]
"""MoE layer path -> the dense FFN's state (names within the FFN), as `dense_to_moe` cuts it out."""


@dataclass(frozen=True)
class Sources:
    """The dense models an upcycle starts from: the base model (whole), and every source's FFNs."""

    base: nn.Module  # gives everything outside the routed experts; the logits are compared against it
    names: tuple[str, ...]  # each source's description (its path, with what fitting it changed)
    checkpoints: tuple[Union[str, Path, None], ...]  # as given, to read a source again for the logit check
    ffns: tuple[FFNStates, ...]  # per source
    base_ffns: FFNStates  # the base's FFNs: shared experts, `pre` modules, bank buffers
    base_mode: str  # `upcycle.base`

    @property
    def count(self) -> int:
        return len(self.names)

    def base_label(self) -> str:
        """Where everything outside the routed experts came from, in words."""
        if self.base_mode == "average" and self.count > 1:
            return f"the average of sources 0 to {self.count - 1} (base: average)"
        return "source 0 (base: first)"


def as_checkpoints(checkpoint: Checkpoints) -> list[Union[str, Path, None]]:
    """`upcycle`'s checkpoint argument as a list of sources: None is the spec's dense source."""
    if checkpoint is None or isinstance(checkpoint, (str, Path)):
        return [checkpoint]
    checkpoints = list(checkpoint)
    if not checkpoints:
        raise MoespecError("no dense checkpoint given: pass one or more, or none for the spec's own dense source")
    return checkpoints


def read_sources(spec: Spec, checkpoint: Checkpoints, *, seed: int, trust_pickle: bool) -> tuple[Sources, Plan]:
    """Every source fitted to the spec's model, the base made, and the plan (from the first source). A source
    that does not fit the backbone is an error naming it and its first mismatching tensors."""
    checkpoints = as_checkpoints(checkpoint)
    several = len(checkpoints) > 1
    base, name, fresh = _read(spec, checkpoints[0], 0, several, seed, trust_pickle)
    plan = plan_for(spec, base)  # the plan `create_model` builds: the dense model is the spec's backbone
    check_experts_from(spec, len(checkpoints))
    check_every_source_used(spec, plan, len(checkpoints))
    average = spec.upcycle.base == "average" and several
    names, ffns = [name], [_own_ffns(plan, base.state_dict(), copy=average)]
    sums, shares = (_start_average(base, fresh) if average else (None, None))
    for index, path in enumerate(checkpoints[1:], 1):
        dense, name, fresh = _read(spec, path, index, several, seed, trust_pickle)
        state = dense.state_dict()
        names.append(name)
        ffns.append(_own_ffns(plan, state, copy=average))
        if sums is not None:
            _add_to_average(sums, shares, state, fresh)
        del dense, state  # only the FFNs stay
    if sums is not None:
        with torch.no_grad():
            for key, tensor in base.state_dict().items():
                if shares.get(key):  # a tensor every source lacks keeps the base's fresh init
                    tensor.copy_((sums[key] / shares[key]).to(tensor.dtype))
    base_ffns = _own_ffns(plan, base.state_dict(), copy=False)
    sources = Sources(base, tuple(names), tuple(checkpoints), tuple(ffns), base_ffns, spec.upcycle.base)
    return sources, plan


def _read(spec: Spec, checkpoint, index: int, several: bool, seed: int, trust_pickle: bool):
    """One source, with the same fresh init for whatever it lacks as a one-source upcycle gets."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # a dense model without weights gets a reproducible fresh init
        try:
            return dense_model_and_fresh(spec, checkpoint, trust_pickle=trust_pickle)
        except CheckpointError as error:
            if not several:
                raise
            raise CheckpointError(f"source {index} ({checkpoint}): {error}") from None


def _own_ffns(plan: Plan, state: dict[str, torch.Tensor], *, copy: bool) -> FFNStates:
    """The planned FFNs' tensors of `state`; copies where the state is overwritten later (the average)."""
    _, ffns = dense_to_moe(plan, state)
    if copy:
        return {path: {name: t.clone() for name, t in ffn.items()} for path, ffn in ffns.items()}
    return ffns


def _start_average(base: nn.Module, fresh: frozenset[str]):
    """Running float64 sums and counts of every floating-point tensor, from the first source."""
    sums, shares = {}, {}
    for key, tensor in base.state_dict().items():
        if tensor.is_floating_point():
            sums[key] = torch.zeros(tensor.shape, dtype=torch.float64)
            shares[key] = 0
    _add_to_average(sums, shares, base.state_dict(), fresh)
    return sums, shares


def _add_to_average(sums: dict, shares: dict, state: dict[str, torch.Tensor], fresh: frozenset[str]) -> None:
    for key in sums:
        if key not in fresh:
            sums[key] += state[key].double()
            shares[key] += 1


def check_experts_from(spec: Spec, count: int) -> None:
    """Every source `upcycle.experts_from` names is one of the `count` given."""
    named = spec.upcycle.experts_from or []
    beyond = sorted({i for i in named if i >= count})
    if beyond:
        given = "1 checkpoint was" if count == 1 else f"{count} checkpoints were"
        raise SpecError(spec_problem(spec, "upcycle.experts_from",
                                     f"names source {beyond[0]}, but {given} given (sources 0 to {count - 1}); "
                                     f"give more checkpoints or name sources below {count}"))


def check_every_source_used(spec: Spec, plan: Plan, count: int) -> None:
    """More sources than experts, by the default rule (expert i takes source i mod n) under `base: first`, is
    most likely a mistake: the sources beyond the experts would be read and then left out of the model. Sources
    that `upcycle.experts_from` leaves out were chosen so (the report says each expert's source, and the logit
    error against every source given), and under `base: average` every source goes into the base's mean."""
    layers = [layer for layer in plan.layers if plan.rebuilt(layer.path) is None]
    if count < 2 or spec.upcycle.base == "average" or spec.upcycle.experts_from is not None or not layers:
        return
    widest = max(layers, key=lambda layer: layer.num_experts)
    unused = list(range(widest.num_experts, count))
    if not unused:
        return
    which = f"source {unused[0]}" if len(unused) == 1 else f"sources {unused[0]} to {unused[-1]}"
    raise SpecError(spec_problem(spec, f"moe.{widest.group}.experts",
                                 f"{count} sources for {widest.num_experts} experts: expert i takes source i mod "
                                 f"{count}, so {which} would give no expert, and base: first takes everything else "
                                 f"from source 0; give at most {widest.num_experts} checkpoints, name each expert's "
                                 f"source in upcycle.experts_from, or use base: average to fold the others into the "
                                 f"base's mean"))


def expert_sources(spec: Spec, layer: LayerPlan, count: int) -> tuple[int, ...]:
    """The source of each routed expert of `layer`: `upcycle.experts_from`, else i mod `count`."""
    named = spec.upcycle.experts_from
    return tuple(named) if named is not None else tuple(i % count for i in range(layer.num_experts))

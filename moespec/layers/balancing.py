"""When the balancing biases move: once per optimizer step, with or without a call in the training loop.

    update_bias(model, group)             one step of DeepSeek-V3's aux-loss-free balancing, called by the loop
    update_bias_on_step(model, optimizer) the same, before every step of `optimizer` (a step pre-hook)
    BIAS_ON_STEP                          the default: after every step of any torch optimizer that holds an MoE
                                          layer's parameters (torch's global optimizer step post-hook)

A loop that never calls moespec (timm's train.py, with or without --grad-accum-steps) still moves the biases as
often as its optimizer steps: every training forward that counted choices enrols its layer, and torch calls
`BIAS_ON_STEP.on_step` after each `optimizer.step()` of every optimizer. It steps the enrolled layers whose
parameters that optimizer holds, with the loads their forwards counted since the last step (all micro-batches
of an accumulation). A layer that `update_bias` or `update_bias_on_step` has stepped is the loop's from then on
(its group may be one only the loop knows); a loop that passes `group` registers `update_bias_on_step` before
its first step. Forwards that go on without any step (an optimizer torch does not see, or training-mode
forwards outside training) cannot be told from a long accumulation: past `FORWARDS_WITHOUT_STEP` of them, one
warning names `update_bias_on_step`.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..errors import MoespecError
from .interfaces import MoELayer
from .ops.collectives import all_reduce_sum

FORWARDS_WITHOUT_STEP = 256
"""Training forwards of one layer without a bias step before `BiasOnStep` warns: more micro-batches than any
accumulation uses."""


def _balance(layer: nn.Module):
    """The layer's `BalancingBias`, or None (a router without `bias_balance`, a Soft MoE layer)."""
    return getattr(getattr(layer, "router", None), "balance", None) if isinstance(layer, MoELayer) else None


def step_biases(layers: list[tuple[str, nn.Module]], group=None) -> int:
    """One bias step of each (name, MoE layer) with a balancing bias, its loads summed over the ranks that train
    it (`update_bias`); the loads start again from zero. Returns the number of layers stepped."""
    by_group: dict[object, list[tuple[str, nn.Module]]] = {}
    for name, layer in layers:
        balance = _balance(layer)
        if balance is not None:
            own = group if group is not None else layer.experts.transport.stats
            by_group.setdefault(own if own is not None else _world(), []).append((name, balance))
    for own, balances in by_group.items():  # one collective per group, in module order on every rank
        loads = all_reduce_sum([balance.tokens_per_expert for _, balance in balances], own)
        for (name, balance), load in zip(balances, loads, strict=True):
            try:
                balance.step(load)
            except MoespecError as error:  # a bias that is not finite: named, never written
                raise MoespecError(f"{name}: {error}") from None
    return sum(len(balances) for balances in by_group.values())


def update_bias(model: nn.Module, group=None) -> int:
    """One step of DeepSeek-V3's auxiliary-loss-free load balancing for every MoE layer of `model` whose router
    has `bias_balance`: each expert's bias moves by `rate * sign(mean load - load_e)`, the loads being the
    top-k choices the training forwards made since the last call (every micro-batch of a gradient
    accumulation), and the accumulated loads start again from zero. Returns the number of layers updated.

    Without it, the biases move after every step of a torch optimizer that holds the model's parameters
    (`BIAS_ON_STEP`); once called, the layers are the loop's. Call it once per optimizer step, before or after
    `optimizer.step()` (torchtitan does it in an optimizer pre-step hook; `update_bias_on_step` registers one).
    The loads are summed over the ranks that train the layer, so that the bias follows the global loads and
    stays equal on every rank (a collective: every rank calls it): over `group` where given; else over the
    layer's expert-parallel group, under expert parallelism; else over all ranks
    (`torch.distributed.group.WORLD`) where torch.distributed is initialized, as in data-parallel training.
    Pass `group` where the ranks that train a layer are fewer (pipeline stages, replicas of a hybrid sharding);
    without torch.distributed each process's own loads move its bias.
    """
    layers = [(name, layer) for name, layer in model.named_modules() if _balance(layer) is not None]
    for _, layer in layers:
        _balance(layer).by_loop = True
    return step_biases(layers, group)


def _world():
    """All ranks' group where torch.distributed is initialized, else None (this process alone)."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed.group.WORLD if initialized else None


def update_bias_on_step(model: nn.Module, optimizer: torch.optim.Optimizer, group=None):
    """Call `update_bias(model, group)` before every `optimizer.step()` (an optimizer step pre-hook, as
    torchtitan registers one); returns the hook's handle (`.remove()` stops it). The model's layers are the
    loop's from now on (`BIAS_ON_STEP` leaves them)."""
    for layer in model.modules():
        if _balance(layer) is not None:
            _balance(layer).by_loop = True

    def hook(*_) -> None:  # a pre-hook that returns something replaces the step's arguments
        update_bias(model, group)

    return optimizer.register_step_pre_hook(hook)


class BiasOnStep:
    """Steps the balancing biases after every optimizer step that concerns them (module docstring)."""

    def __init__(self):
        self.layers: weakref.WeakKeyDictionary[nn.Module, None] = weakref.WeakKeyDictionary()  # in enrolment order
        self.hook = None
        self.warned = False

    def on_forward(self, layer: nn.Module) -> None:
        """A training forward of `layer` counted its choices."""
        balance = _balance(layer)
        if balance is None:
            return
        if layer not in self.layers:
            self.layers[layer] = None
        if self.hook is None:
            self.hook = register_optimizer_step_post_hook(self.on_step)
        balance.forwards += 1
        if balance.forwards > FORWARDS_WITHOUT_STEP and not self.warned:
            self.warned = True
            warnings.warn(f"moespec: {balance.forwards} training forwards of an MoE layer with bias_balance and no "
                          f"step of a torch optimizer holding its parameters: its balancing bias has not moved. "
                          f"If your loop steps another kind of optimizer, call moespec.update_bias(model) once per "
                          f"step, or register moespec.update_bias_on_step(model, optimizer)", stacklevel=4)

    def on_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        due = [(_path(layer), layer) for layer in list(self.layers) if not _balance(layer).by_loop
               and any(id(p) in held for p in layer.parameters())]
        if due:
            step_biases(due)


def _path(layer: nn.Module) -> str:
    """The layer's qualified name in its model (its `LayerPlan`'s), for messages."""
    return getattr(getattr(layer, "plan", None), "path", None) or type(layer).__name__


BIAS_ON_STEP = BiasOnStep()

"""Optimizer parameter groups for a compiled model: timm's, with the routed experts at their own weight decay.

    optimizer_groups(model, weight_decay, expert_weight_decay=None, layer_decay=None)  -> torch param groups

The sweet-spot study regularizes its experts with a weight decay of their own (seed 001, Table 12): an expert
sees about k/E of the items a dense FFN sees, so it overfits sooner. timm's rules decide what decays at all
(`timm.optim.create_optimizer_v2`): no decay for 1-D parameters, biases and the names in the model's
`no_weight_decay()`; with `layer_decay`, BEiT's layer-wise learning-rate scale by timm's `group_matcher`. The
groups come from timm's own functions; this module only says which parameters are experts.
"""

from __future__ import annotations

import math
from typing import Any

from timm.optim._param_groups import param_groups_layer_decay, param_groups_weight_decay
from torch import nn

from ..compiler import moe_layers
from ..errors import MoespecError


def optimizer_groups(model: nn.Module, weight_decay: float, expert_weight_decay: float | None = None,
                     layer_decay: float | None = None) -> list[dict[str, Any]]:
    """Param groups for `torch.optim` / `timm.optim.create_optimizer_v2(groups, ...)`.

    Args:
        model: a compiled model (`create_model`, `load`); a dense timm model works too (it has no experts).
        weight_decay: the decay of every parameter that timm decays (>= 2-D, not a bias, not in
            `model.no_weight_decay()`).
        expert_weight_decay: the decay of the routed experts' weights instead (`None`: `weight_decay`, so the
            groups are timm's). Shared experts and routers keep `weight_decay`: they see every item. An
            expert's bias or norm vector, stacked into an [E, H] tensor, never decays: the compiled model's
            `no_weight_decay()` names it, as the dense FFN's 1-D one is not decayed.
        layer_decay: timm's `param_groups_layer_decay` (each group has an `lr_scale`, which timm's schedulers
            apply); `None`: timm's `param_groups_weight_decay`.

    Returns:
        timm's groups, in timm's order, where each decayed group that holds routed expert weights is followed
        by a copy of it (same `lr_scale`) that holds them, at `expert_weight_decay`.

    A decay that is not a finite number >= 0, or a `layer_decay` outside (0, 1], is a `MoespecError` before
    any group is made: one AdamW step at a NaN, infinite or negative decay leaves non-finite or growing weights.
    """
    _check_number("weight_decay", weight_decay)
    _check_number("expert_weight_decay", expert_weight_decay, optional=True)
    _check_number("layer_decay", layer_decay, optional=True, high=1.0)
    # a compiled model's no_weight_decay() names the experts' stacked vectors too (`compiler/model.py`)
    no_decay = set(getattr(model, "no_weight_decay", set)())
    experts = {id(p) for layer in moe_layers(model).values() for p in layer.experts.parameters()}
    # timm puts everything in one undecayed group at weight_decay 0: ask for the decayed groups all the same
    decay = weight_decay if weight_decay or not expert_weight_decay else expert_weight_decay
    if layer_decay is None:
        groups = param_groups_weight_decay(model, decay, no_weight_decay_list=no_decay)
    else:
        groups = param_groups_layer_decay(model, decay, no_weight_decay_list=no_decay, layer_decay=layer_decay)
    if expert_weight_decay is None:
        return groups
    split = []
    for group in groups:
        if not group["weight_decay"]:
            split.append(group)
            continue
        rest = [p for p in group["params"] if id(p) not in experts]
        routed = [p for p in group["params"] if id(p) in experts]
        split += [{**group, "params": rest, "weight_decay": weight_decay}] if rest else []
        split += [{**group, "params": routed, "weight_decay": expert_weight_decay}] if routed else []
    return split


def _check_number(name: str, value: Any, *, optional: bool = False, high: float | None = None) -> None:
    """`value` is a real number (not a bool or a string), finite, >= 0 (> 0 and <= `high` where given)."""
    if value is None and optional:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    in_range = number and (0 < value <= high if high is not None else value >= 0)
    if not in_range:
        allowed = f"a number in (0, {high:g}]" if high is not None else "a finite number >= 0"
        allowed += " or None" if optional else ""
        raise MoespecError(f"optimizer_groups: {name} is {value!r}; allowed: {allowed}")

"""The expert steps, as one table, and the one way to force a step.

    loop        each expert's whole FFN on its contiguous segment in turn (loop.py)
    padded      rows scattered into [E, largest segment, C] and two `bmm`s (padded.py)
    grouped_mm  `F.grouped_mm` over the jagged segments, no host sync (grouped_mm.py)
    triton      the fused Triton kernels, forced only (triton.py, over `layers/fused.py`)

Each step implements `base.ExpertStep` (what it cannot run, how it runs the sorted rows, whether it fuses the
gather and the combine); a new step is one file and one line in `STEPS`. All compute the same function. Under
"auto" (the default) `dispatch.auto_step` picks one for the device, dtype, widths, rows and whether autograd
records; `Experts.strategy` asks it once per layer call and passes the step down. `set_expert_step(model,
name)` forces every expert bank of a model to one step ("auto" restores the rule);
`moespec.create_model(spec, expert_step=name)` builds a model so.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..fused import unavailable
from .base import ExpertStep
from .grouped_mm import GroupedStep
from .loop import LoopStep
from .padded import PaddedStep
from .triton import TritonStep

STEPS: dict[str, ExpertStep] = {step.name: step for step in (LoopStep(), PaddedStep(), GroupedStep(), TritonStep())}
"""The table: step name -> the step."""

EXPERT_STEPS: tuple[str, ...] = tuple(STEPS)
"""Every step a bank can be forced to; "auto" besides them lets the rule pick."""


def check_step(name: str) -> str:
    """`name` if it is "auto" or a step of the table, else a ValueError that lists them."""
    if name not in ("auto", *EXPERT_STEPS):
        raise ValueError(f"unknown expert step {name!r}; the steps are: auto, {', '.join(EXPERT_STEPS)}")
    return name


def available_steps(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[str, ...]:
    """The steps of the table that can run on `device` in `dtype`: every one, but triton where its kernels cannot
    run (`fused.unavailable`: no Triton, or the CPU outside Triton's interpreter)."""
    device = torch.device(device)
    return tuple(step for step in EXPERT_STEPS if step != "triton" or unavailable(device, dtype) is None)


class ChoosesStep:
    """A module whose expert step is configuration (`Experts`): `step`, "auto" or a step of the table, set per
    instance (`set_expert_step`) and read by the one chooser (`Experts.strategy`)."""

    step: str

    @property
    def dispatch(self) -> str:
        """The release 0.1 name of `step`, kept for scripts that assign it (shared/gpu/gpu_check.py); assigning
        warns and goes through `check_step`."""
        return self.step

    @dispatch.setter
    def dispatch(self, name: str) -> None:
        warnings.warn("Experts.dispatch is deprecated: use moespec.set_expert_step(model, name)", DeprecationWarning,
                      stacklevel=2)
        self.step = check_step(name)


def set_expert_step(model: nn.Module, name: str) -> nn.Module:
    """Force every expert bank of `model` (a model, a layer or a bank) to the step `name`; "auto" lets the rule
    pick again. Returns the model. Shared experts keep their own path (every expert on every item)."""
    check_step(name)
    for module in model.modules():
        if isinstance(module, ChoosesStep):
            module.step = name
    return model

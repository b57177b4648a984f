"""The expert steps, as one table, the one chooser, and the one way to force a step: the tier between the
modules (`layers/`) and the ops (`layers/ops/`).

    loop        each expert's whole FFN on its contiguous segment in turn (loop.py)
    padded      rows scattered into [E, largest segment, C] and two `bmm`s (padded.py)
    grouped_mm  `F.grouped_mm` over the jagged segments, no host sync (grouped.py)
    triton      the scattered Triton kernels, forced only (triton.py, over `ops/scattered.py`)

Each step implements `base.ExpertStep` (what it cannot run, how it runs the sorted rows, whether it gathers and
combines the pairs itself) against the bank's declared surface (`bank.ExpertBank`); a new step is one file and
one line in `STEPS`. All compute the same function. Beside them: what routing hands the steps (`rows.py`), where
the rows are computed (`transport.py`: this process, or over ranks), and the rule "auto" follows (`rule.py`).

`choose` picks the step once per layer call: the forced one, or under "auto" the rule's, for the call's `Mode`,
the dtype, widths and rows. `set_expert_step(model, name)` forces every expert bank of a model to one step
("auto" restores the rule); `moespec.create_model(spec, expert_step=name)` builds a model so.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..ops.mode import Mode
from ..ops.scattered import unavailable
from .bank import ExpertBank
from .base import ExpertStep
from .grouped import GroupedStep
from .loop import LoopStep
from .padded import PaddedStep
from .rule import auto_step, equal_segments_step
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
    run (`ops.scattered.unavailable`: no Triton, or the CPU outside Triton's interpreter)."""
    device = torch.device(device)
    return tuple(step for step in EXPERT_STEPS if step != "triton" or unavailable(device, dtype) is None)


def choose(bank: ExpertBank, rows: int, like: torch.Tensor, counts: torch.Tensor, mode: Mode,
           equal: bool = False) -> str:
    """The step for `rows` rows of `like`'s dtype (`counts` [E] per local expert) in a call that runs as `mode`
    says: the bank's forced `step` (which raises, saying why, where it cannot run), the loop for GRN experts, else
    the rule (`rule.auto_step`; `equal`: segments of one length, Soft MoE's slots, `rule.equal_segments_step`).
    A layer call asks once (`Experts.combine`), or once more for the rows it receives from other ranks."""
    if bank.step != "auto":
        why = STEPS[bank.step].unavailable(bank, like, mode)
        if why is not None:
            raise RuntimeError(f"the expert step {bank.step!r} cannot run: {why}")
        if bank.step == "triton":
            return "triton"
    if bank.needs_groups:
        return "loop"
    if bank.step != "auto":
        return bank.step
    if equal:
        return equal_segments_step(rows // max(1, counts.numel()), mode)
    aligned = all(width * like.element_size() % 16 == 0 for width in bank.widths)
    return auto_step(rows, like.dtype, counts, aligned, mode)


class ChoosesStep:
    """A module whose expert step is configuration (`Experts`): `step`, "auto" or a step of the table, set per
    instance (`set_expert_step`) and read by the one chooser (`choose`)."""

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

"""What the expert steps and the transport use of an expert bank: a declared surface, as torchtitan's dispatcher
and experts talk through one. `layers.experts.Experts` implements it; tests/layers/test_bank_protocol.py runs the
steps on a fake bank that implements nothing else."""

from __future__ import annotations

from typing import Callable, Iterator, Protocol

import torch
from torch import nn

from ..ops.mode import Mode
from .rows import RoutedRows, Segments


class Transport(Protocol):
    """Where a bank's rows are computed (`transport.py`): `local` (this process), the aux losses' `group`."""

    local: bool
    group: object

    def parameters(self, params: list) -> list: ...


class ExpertBank(Protocol):
    """E experts of one FFN structure, their weights stacked on a leading expert axis.

    Attributes:
        step: "auto" or the step forced on the bank (`set_expert_step`).
        local_experts: the experts stacked here (E, or this rank's share under expert parallelism).
        hidden / out_features: H, C' of one expert.
        widths: every row width the FFN's matmuls read (grouped_mm's kernels need 16-byte row strides).
        needs_groups: whether the FFN needs each row's image (GRN).
        act, glu, inner_norm, drop, training: the FFN's activation module, GLU order (None: plain), inner norm,
            dropout after the activation and after fc2, and the module's training flag.
        clamped: the projections clamp their inputs and outputs (Gemma 4's clippable linears).
        weight_dtype: the dtype of the stacked weights.
        transport: where the rows go (`transport.Local`, or over ranks).
    """

    step: str
    local_experts: int
    hidden: int
    out_features: int
    widths: tuple[int, ...]
    needs_groups: bool
    act: nn.Module
    glu: str | None
    inner_norm: str
    drop: tuple[float, float]
    training: bool
    clamped: bool
    weight_dtype: torch.dtype
    transport: Transport

    def params(self) -> list[torch.Tensor | None]:
        """[fc1 weight [E, H', C], fc1 bias, inner norm weight [E, H], its bias, fc2 weight [E, C', H], fc2 bias]
        (None where absent), as the transport hands them to the steps."""

    def ffn(self, x: torch.Tensor, params: list, groups: torch.Tensor | None,
            linear: Callable | None = None, activated: Callable | None = None) -> torch.Tensor:
        """One expert on rows x [S, C] (params of one expert), or every expert on a padded batch [E, M, C]
        (stacked params, norm params [E, 1, H]); `linear(x, weight, bias)` applies fc1 / fc2, `activated(x, w1, b1)`
        fc1 and the activation."""

    def stacked(self, x: torch.Tensor, mode: Mode) -> torch.Tensor:
        """The experts stacked here on x [local_experts, M, C] -> [local_experts, M, C']."""

    def run_local(self, x: torch.Tensor, segments: Segments, groups: torch.Tensor | None, mode: Mode,
                  step: str | None = None) -> torch.Tensor:
        """Rows x [S, C] sorted by this bank's experts through `step` (None: the chooser's) -> [S, C']."""

    def run_slots(self, x: torch.Tensor, mode: Mode) -> torch.Tensor:
        """Equal segments x [local_experts, M, C] (Soft MoE's slots) through the chosen step."""

    def step_combines(self, rows: RoutedRows) -> bool:
        """Whether a step may gather and combine the routed pairs around its matmuls (each item's k rows known, the
        rows stay on this rank, no image groups, no clamps)."""

    def parameters(self) -> Iterator[nn.Parameter]: ...

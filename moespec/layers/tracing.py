"""Whether torch.compile or torch.export is tracing the call: the one question every layer's sync-free choice
(`dispatch.sync_free`) and the grouped matmuls' visibility to inductor (`grouped.py`) ask. A module of its own
below both, which `dispatch` imports from `grouped`."""

from __future__ import annotations

import torch


def traced() -> bool:
    """Whether torch.export or torch.compile is tracing this call (torch < 2.3 has no such query)."""
    return getattr(torch.compiler, "is_compiling", lambda: False)()


def exporting() -> bool:
    """Whether torch.export is tracing this call: the flag `torch.compiler.is_exporting()` reads, read directly.
    torch 2.11's Dynamo answers the call itself with True under torch.compile too, and the MoE layers took the
    export path there (every expert on every item, no routing state, so `moespec.aux_loss` returned an
    earlier step's losses); torch 2.14 answers it right."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)

"""Whether moespec's Triton kernels are here: the one place `ops/` imports `layers/kernels/`.

`bias_act_kernels`, `pair_kernels` and `scattered_kernels` are the kernels' modules, or None without Triton
(`INSTALLED`). An op runs
its kernels where `on_device` says so for its own tensors, else its torch ops.
"""

from __future__ import annotations

import os

import torch

try:
    from ..kernels import bias_act as bias_act_kernels
    from ..kernels import pairs as pair_kernels
    from ..kernels import scattered as scattered_kernels
except ImportError:  # no Triton: the torch ops run everywhere
    bias_act_kernels = pair_kernels = scattered_kernels = None

INSTALLED = scattered_kernels is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter runs the kernels on CPU


def on_device(*tensors: torch.Tensor | None) -> bool:
    """Whether the kernels run on these tensors (None: absent): Triton installed, CUDA tensors of at most 32 bits
    (the kernels compute in fp32)."""
    present = [t for t in tensors if t is not None]
    return INSTALLED and present[0].is_cuda and not any(t.dtype == torch.float64 for t in present)

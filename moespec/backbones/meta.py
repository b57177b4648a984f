"""Initializers skipped on the meta device, where the values they would write do not exist.

A model built on the meta device (for planning, counting and the memory check) still runs timm's
initialization: `trunc_normal_` is `uniform_`, `erfinv_`, `mul_`, `add_` and `clamp_` on every weight. On meta
tensors each of those goes through torch's Python meta functions, so building ViT-S/16 on the meta device took
0.25 s, 0.06 s without them (ConvNeXt-T: 0.33 s, 0.08 s); `moespec stats` builds each spec on it twice, the test
suite hundreds of times. The writes change values only, never a shape, dtype or stride, so skipping them
changes nothing that a meta tensor has.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

VALUE_WRITES = frozenset({
    "zero_", "fill_", "uniform_", "normal_", "erfinv_", "clamp_", "clamp_min_", "clamp_max_", "add_", "sub_",
    "mul_", "div_", "copy_", "exp_", "log_", "sqrt_", "neg_", "abs_", "pow_", "bernoulli_", "random_",
    "exponential_", "log_normal_", "cauchy_", "geometric_", "masked_fill_", "addcmul_", "addcdiv_", "lerp_",
})
"""In-place tensor methods that only write values; the initializers of timm and torch.nn.init are made of them.
Methods that change metadata in place (`resize_`, `requires_grad_`, `unsqueeze_`, ...) are not here."""


class SkipMetaWrites(TorchFunctionMode):
    """While active, a value write (`VALUE_WRITES`) to a meta tensor returns that tensor at once; every other
    call, and every write to a real tensor, runs as usual."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if (getattr(func, "__name__", None) in VALUE_WRITES and args and isinstance(args[0], torch.Tensor)
                and args[0].is_meta):
            return args[0]
        return func(*args, **(kwargs or {}))

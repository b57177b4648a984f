"""Deprecated: the release 0.1 home of the triton step's `unavailable`, kept because ../shared/gpu/gpu_check.py
imports it from here. Use `moespec.layers.available_steps(device, dtype)`; the kernels' op is `ops/scattered.py`."""

from .ops.scattered import unavailable

__all__ = ["unavailable"]

"""Deprecated: the release 0.1 home of `device_path`, kept because ../shared/gpu/gpu_check.py imports it from
here. Use `moespec.layers.device_path` (`ops/mode.py`); the step rule is `steps/rule.py`."""

from .ops.mode import device_path

__all__ = ["device_path"]

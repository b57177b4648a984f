"""moespec's architecture in timm's registry, from `import moespec` on, whichever of moespec and timm comes first.

`timm.create_model("local-dir:FOLDER")` and `("hf-hub:ORG/NAME")` build the entry point that the folder's
config.json names (`spec.HUB_ARCHITECTURE`). `install()` (run by `import moespec`) registers it at once when timm
is loaded, else right after timm's own import finishes, so that `import moespec` stays free of torch and timm
(tests/test_cli_imports.py). This module imports neither at import time.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from typing import Any

from ..spec import HUB_ARCHITECTURE

_lock = threading.Lock()
_registered = False


def install() -> None:
    """Register moespec's architecture with timm now if timm is imported, else once it is."""
    timm = sys.modules.get("timm")
    if timm is not None and hasattr(timm, "create_model"):
        register()
    elif not any(isinstance(finder, _AfterTimmImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterTimmImport())


def register() -> None:
    """Add `HUB_ARCHITECTURE` to timm's registry (once)."""
    global _registered
    with _lock:
        if _registered:
            return
        import timm.models  # deferred: seconds that `import moespec` does not pay; timm is loaded when this runs

        timm.models.register_model(hub_model)
        _registered = True


def hub_model(pretrained: bool = False, **kwargs: Any):
    """The MoE model of a Hub folder's spec (`apps.hub.create_hub_model`)."""
    from .hub import create_hub_model  # deferred: the compile stack, imported when a model is built

    return create_hub_model(pretrained=pretrained, **kwargs)


hub_model.__name__ = hub_model.__qualname__ = HUB_ARCHITECTURE  # timm registers an entry point by its name
setattr(sys.modules[__name__], HUB_ARCHITECTURE, hub_model)  # timm lists entry points as attributes of their module


class _AfterTimmImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the import of `timm`, it lets the other finders find it and runs `register`
    after timm's module has run, then leaves `sys.meta_path`. It stays until timm's module runs: a probe that
    only finds timm's spec (`importlib.util.find_spec("timm")`, which transformers runs to see whether timm is
    installed) imports nothing, and the import that follows must still register."""

    def find_spec(self, name, path=None, target=None):
        if name != "timm":
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *_: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module) -> None:
                run(module)
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                register()

            spec.loader.exec_module = exec_module
        return spec

"""Names of a package imported from their modules on first use (PEP 562), for the packages whose modules import
torch: `import moespec` and `moespec.io` resolve every public name without paying seconds for torch up front."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Sequence


def lazy_names(package: str, namespace: dict[str, Any], where: Mapping[str, str], public: Sequence[str]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module `__getattr__` and `__dir__` of `package` (its `globals()` is `namespace`): a name of `where`
    (public name -> the module, relative to `package`, that defines it) is imported on first use and kept in
    `namespace`, so that later lookups skip `__getattr__`."""

    def getattr_(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{where[name]}", package), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(public))

    return getattr_, dir_

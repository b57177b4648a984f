"""Where a model is built, and whether it fits there.

    resolve_device(device)              the torch.device a build goes to, or a MoespecError saying what is allowed
    refuse_if_too_large(meta, device)   refuse a build whose tensors need more than a share of the device's memory
    module_budget(what)                 while it lasts, refuse a build that makes more than MAX_BACKBONE_MODULES

A build is first made on the meta device (shapes, no storage), counted, and only then made for real, so that a
spec too large for the machine is a clear error instead of the out-of-memory killer or a half-allocated model.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections import defaultdict
from typing import Iterator

import torch
from rich.filesize import decimal
from torch import nn

from ..errors import MoespecError, Problem, SpecError

MEMORY_SHARE = 0.8
"""The share of a device's memory that one build may take (the rest: activations, the OS, other processes)."""
MAX_BACKBONE_MODULES = 10_000
"""Submodules a backbone may register while it is built: 4 x the most of any of timm's 1,371 models at their
defaults (resnetrs420: 2,541; efficientnet_l2: 1,757; ViT-g/14: 1,068). Even a build on the meta device costs a
Python object per module, about 0.2 ms and a few kB each, so `depth: 1000000` took gigabytes and hours before
any tensor was counted."""


def resolve_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device that this machine has: "cpu", "meta", "cuda", "cuda:N" (or any accelerator
    torch knows and finds here, e.g. "mps")."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise MoespecError(f"unknown device {str(device)!r}; expected cpu, cuda, cuda:N, meta, or another "
                           f"device type torch knows (mps, xpu, ...)") from None
    if resolved.type in ("cpu", "meta"):
        return resolved
    backend = getattr(torch, resolved.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        raise MoespecError(f"device {str(device)!r}: this machine has no {resolved.type} device "
                           f"(torch.{resolved.type}.is_available() is False); use device='cpu'")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if resolved.index is not None and resolved.index >= count:
        raise MoespecError(f"device {str(device)!r}: this machine has {count} {resolved.type} device(s), "
                           f"{resolved.type}:0 to {resolved.type}:{count - 1}")
    return resolved


def device_memory(device: torch.device) -> int:
    """Bytes of memory of `device`: this machine's RAM for the CPU, the accelerator's own otherwise."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def tensor_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of each parameter and buffer of `model` (each shared tensor once), by qualified name. Works on
    the meta device, where nothing is allocated."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {name: t.numel() * t.element_size() for name, t in tensors}


def refuse_if_too_large(meta_model: nn.Module, device: torch.device, what: str, field: str = "",
                        share: float = MEMORY_SHARE) -> None:
    """Refuse to build `meta_model` (built on the meta device: nothing allocated) for real on `device` when its
    parameters and buffers need more than `share` of the device's memory: a SpecError at the spec's `field`
    (the caller locates it in the file) with the bytes needed and allowed and the biggest contributors, grouped
    over repeated blocks."""
    if device.type == "meta":
        return
    sizes = tensor_bytes(meta_model)
    needed, memory = sum(sizes.values()), device_memory(device)
    if needed <= share * memory:
        return
    groups: dict[str, list[int]] = defaultdict(list)
    for name, size in sizes.items():
        groups[re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", name)].append(size)
    biggest = sorted(groups.items(), key=lambda item: -sum(item[1]))[:3]
    listed = ", ".join(f"{name} {decimal(sum(s))}" + (f" ({len(s)} tensors)" if len(s) > 1 else "")
                       for name, s in biggest)
    machine = "this machine's memory" if device.type == "cpu" else f"the memory of {device}"
    allowed = f"{share:.0%} of {machine} ({decimal(int(share * memory))} of {decimal(memory)})"
    raise SpecError(Problem(f"{what} needs {decimal(needed)} for its parameters and buffers, more than {allowed}; "
                            f"too large to build here. Biggest: {listed}. `moespec plan` and `moespec validate` "
                            f"still work: they allocate nothing", path=field))



class TooManyModules(Exception):
    """Raised inside a build that went past `MAX_BACKBONE_MODULES` (`module_budget`), to stop it there."""


@contextlib.contextmanager
def module_budget(limit: int | None = None) -> Iterator[None]:
    """While it lasts, a module registered as the `limit + 1`-th submodule (default: `MAX_BACKBONE_MODULES`)
    raises `TooManyModules`, which stops the build at that point. Counted by torch's global module
    registration hook, so modules that other threads build meanwhile count too (builds are not run concurrently
    here)."""
    count, limit = 0, MAX_BACKBONE_MODULES if limit is None else limit

    def counted(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        nonlocal count
        count += 1
        if count > limit:
            raise TooManyModules(limit)

    handle = torch.nn.modules.module.register_module_module_registration_hook(counted)
    try:
        yield
    finally:
        handle.remove()

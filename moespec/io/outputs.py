"""The checks of an output a command makes before any work, free of torch: `moespec compile -o x.safetensors`
refuses an existing output ("already exists; pass --force") or a bad --max-shard-size in a fraction of a
second, before the seconds of importing torch and timm (26 s on a cold start)."""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import MoespecError
from .atomic import check_name, check_output

INDEX_SUFFIX = ".safetensors.index.json"
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
              "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, option: str) -> int:
    """Bytes from "2GB", "500MB", "1.5GiB" or a plain number of bytes (units as transformers reads them)."""
    number = text.strip().upper().rstrip("BIKMGT")
    unit = text.strip().upper()[len(number):]
    try:
        size = float(number) * SIZE_UNITS[unit]
    except (KeyError, ValueError):
        raise MoespecError(f"{option} {text!r}: expected a size such as 2GB, 500MB or 1GiB") from None
    if not math.isfinite(size) or size < 1:  # inf, nan, 1e400; 0, negative, under a byte
        raise MoespecError(f"{option} {text!r}: expected a finite, positive size such as 2GB, 500MB or 1GiB")
    return int(size)


def check_checkpoint_output(path: str | Path, force: bool) -> Path:
    """`check_output` for a checkpoint: its name must end in `.safetensors` (what it holds, and what readers go
    by), and the index a sharded write printed names the checkpoint only by its base path."""
    path = check_name(path)
    if path.name.endswith(INDEX_SUFFIX) and len(path.name) > len(INDEX_SUFFIX):
        base = path.with_name(path.name.removesuffix(".index.json"))
        raise MoespecError(f"{path} is the index of a sharded checkpoint; name the output by its base path, {base} "
                           f"(its shards and index are written next to it)")
    if not path.name.endswith(".safetensors") or path.name == ".safetensors":
        raise MoespecError(f"{path}: a moespec checkpoint is a safetensors file; name the output NAME.safetensors "
                           f"(beyond the shard size, shards and an index are written next to it)")
    return check_output(path, force)

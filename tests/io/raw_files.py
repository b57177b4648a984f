"""Safetensors files written byte by byte, as a hand-edited or hostile file would be: any header, any data."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def raw_file(path: Path, header: object, data: bytes = b"", *, text: str | None = None) -> Path:
    """Write `header` (JSON; or `text` verbatim) behind its 8-byte little-endian length, then `data`."""
    blob = (json.dumps(header) if text is None else text).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}

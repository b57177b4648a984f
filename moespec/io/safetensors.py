"""The safetensors format, read and written tensor by tensor: headers validated by the safetensors library,
reads straight into a model's tensors, writes that stream one tensor at a time."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from safetensors import SafetensorError, safe_open

from ..choices import PRECISIONS
from ..errors import CheckpointError

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
"""The dtypes moespec writes, by their safetensors names."""

READ_DTYPES = {**{name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}, **{
    name: getattr(torch, attribute) for name, attribute in (
        ("F8_E4M3", "float8_e4m3fn"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2", "float8_e5m2"),
        ("F8_E5M2FNUZ", "float8_e5m2fnuz"), ("F8_E8M0", "float8_e8m0fnu"), ("U16", "uint16"), ("U32", "uint32"),
        ("U64", "uint64"), ("C64", "complex64"))
    if hasattr(torch, attribute)}}
"""The safetensors dtypes moespec reads (and casts into the model's dtype): every one that both the
safetensors library and this torch know and that torch can cast. Not F4 (two values packed in a byte, which
torch cannot cast) nor F6_E2M3 / F6_E3M2 (no torch dtype)."""

MAX_HEADER_BYTES = 100_000_000
"""The safetensors library's own cap on a header (MAX_HEADER_SIZE): no longer header is ever read."""

DTYPE_NAMES = {name: getattr(torch, dtype) for name, dtype in PRECISIONS.items()}
"""The precisions a checkpoint may be written in, by the names the CLI takes (`--dtype bf16`): `choices.PRECISIONS`
as torch dtypes."""


def read_safetensors_header(path: str | Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file (name -> dtype, shape, data_offsets; "__metadata__", always a
    mapping of strings) and the byte offset where the data starts.

    The safetensors library validates the file first (`safe_open`: the header's length cap, its JSON, dtypes,
    shapes, and offsets that are in order, contiguous, non-overlapping and cover the data exactly); only then
    is the header read here, and it must say what the library saw, with offsets that tile the data exactly.
    A tensor whose dtype moespec cannot cast (`READ_DTYPES`) is refused here, naming it."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            seen = {name: (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape()) for name in f.keys()}
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            if size > MAX_HEADER_BYTES:  # the library refuses it too; never read it
                raise ValueError(f"a header of {size} bytes, over the {MAX_HEADER_BYTES} the format allows")
            header = json.loads(f.read(size), object_pairs_hook=_unique_keys)
    except (SafetensorError, OSError, struct.error, ValueError, RecursionError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err}); is it truncated?") from None
    for name, (dtype, _) in seen.items():
        if dtype not in READ_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype}, which moespec cannot read into a "
                                  f"model; it reads {', '.join(READ_DTYPES)}")
    start = 8 + size
    if not isinstance(header, dict) or not _tiles(header, seen, path.stat().st_size - start):
        raise CheckpointError(f"{path}: its header does not say what the safetensors library read from it; "
                              f"not a valid safetensors file")
    header["__metadata__"] = metadata
    return header, start


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object without repeated names: a tensor named twice is ambiguous."""
    found = dict(pairs)
    if len(found) != len(pairs):
        raise ValueError("a name appears twice in the header")
    return found


def _tiles(header: dict, seen: Mapping[str, tuple[str, list[int]]], data_bytes: int) -> bool:
    """Whether `header` names the tensors the library saw, at the same dtypes and shapes, with data_offsets
    that lay them end to end over exactly `data_bytes` bytes (so no read strays outside a tensor's own)."""
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    if tensors.keys() != seen.keys():
        return False
    spans = []
    for name, entry in tensors.items():
        if not isinstance(entry, dict) or [entry.get("dtype"), entry.get("shape")] != list(seen[name]):
            return False
        dtype, shape = seen[name]
        offsets = entry.get("data_offsets")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
            return False
        if offsets[1] - offsets[0] != math.prod(shape) * READ_DTYPES[dtype].itemsize:
            return False
        spans.append(offsets)
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            return False
        end = stop
    return end == data_bytes


def check_castable(path: str | Path, name: str, dtype: str, target: torch.dtype) -> None:
    """Refuse to read a tensor of safetensors dtype `dtype` into a `target` tensor when the cast would lose
    a part of every value (complex into real)."""
    if READ_DTYPES[dtype].is_complex and not target.is_complex:
        raise CheckpointError(f"{path}: tensor {name!r} is complex ({dtype}); the model's is {target}, which would "
                              f"drop the imaginary parts")


def read_safetensors_into(path: str | Path, targets: Mapping[str, torch.Tensor]) -> None:
    """Read each tensor of a safetensors file straight into `targets[name]`'s storage (cast if the dtypes
    differ), with plain reads rather than a memory map: memory holds the targets plus at most one tensor.
    The offsets come from a header the safetensors library validated (`read_safetensors_header`)."""
    header, start = read_safetensors_header(path)
    with open(path, "rb") as f, torch.no_grad():
        for name, entry in header.items():
            if name == "__metadata__" or name not in targets:
                continue
            target, dtype, (begin, end) = targets[name], READ_DTYPES[entry["dtype"]], entry["data_offsets"]
            if tuple(target.shape) != tuple(entry["shape"]):
                raise CheckpointError(f"{path}: {name} is {tuple(entry['shape'])} in the file but "
                                      f"{tuple(target.shape)} in the model")
            check_castable(path, name, entry["dtype"], target.dtype)
            same = target.dtype == dtype and target.is_contiguous() and target.device.type == "cpu"
            buffer = target if same else torch.empty(entry["shape"], dtype=dtype)
            f.seek(start + begin)
            if f.readinto(memoryview(buffer.reshape(-1).view(torch.uint8).numpy())) != end - begin:
                raise CheckpointError(f"{path}: {name} is cut short; is the file truncated?")
            if not same:
                target.copy_(buffer)


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the header alone."""
    header, _ = read_safetensors_header(path)
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


@dataclass(frozen=True)
class TensorInfo:
    """Name, shape and dtype of one tensor to write: enough to lay out shards before any data exists."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()


def write_safetensors(file: Path, infos: Sequence[TensorInfo], tensor: Callable[[TensorInfo], torch.Tensor],
                      metadata: dict[str, str]) -> None:
    """Write a safetensors file tensor by tensor: the header first (from `infos`), then each tensor's bytes as
    `tensor(info)` returns it, so only one tensor needs to exist at a time."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for info in infos:
        header[info.name] = {"dtype": SAFETENSORS_DTYPES[info.dtype], "shape": list(info.shape),
                             "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for info in infos:
            t = tensor(info)
            if tuple(t.shape) != info.shape or t.dtype != info.dtype:
                raise RuntimeError(f"{info.name}: got {tuple(t.shape)} {t.dtype}, laid out as {info.shape} "
                                   f"{info.dtype}")
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy of the bytes



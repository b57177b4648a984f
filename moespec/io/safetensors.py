"""The safetensors format, read and written tensor by tensor: headers validated by the safetensors library,
reads straight into a model's tensors, writes that stream one tensor at a time."""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Mapping, Sequence

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


class CheckpointChanged(CheckpointError):
    """A checkpoint's file was replaced while it was read: another process is writing it. Reading it again
    reads one write whole."""


@dataclass
class SafetensorsFile:
    """A safetensors file held open, with the header validated for that very file (`open_safetensors`): what
    is read through `handle` comes from the write its header describes, whatever replaces `path` meanwhile."""

    path: Path
    handle: BinaryIO
    header: dict
    start: int  # the byte offset where the data starts

    @property
    def metadata(self) -> dict[str, str]:
        return self.header["__metadata__"]

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()


def open_safetensors(path: str | Path) -> SafetensorsFile:
    """Open a safetensors file and read its JSON header (name -> dtype, shape, data_offsets; "__metadata__",
    always a mapping of strings), held open for reading its tensors; close it (`with`) when done.

    The safetensors library validates the file first (`safe_open`: the header's length cap, its JSON, dtypes,
    shapes, and offsets that are in order, contiguous, non-overlapping and cover the data exactly); only then
    is the header read here, from the open file, and it must say what the library saw, with offsets that tile
    the data exactly. The library opens the file by its name: if the name no longer leads to the open file
    after it (a writer replaced it), that is a `CheckpointChanged`. A tensor whose dtype moespec cannot cast
    (`READ_DTYPES`) is refused here, naming it. Anything but a regular file is refused unopened by the library
    (a fifo would block it)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a fifo opens without waiting
    except OSError as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err.strerror or err})") from None
    handle = os.fdopen(fd, "rb")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path}: not a readable safetensors file (not a regular file)")
        header, start = _read_header(path, handle)
    except BaseException:
        handle.close()
        raise
    return SafetensorsFile(path, handle, header, start)


def _read_header(path: Path, handle: BinaryIO) -> tuple[dict, int]:
    try:
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                seen = {name: (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape()) for name in f.keys()}
        finally:  # what the library read must be the open file
            if not _still_at(path, handle):
                raise CheckpointChanged(f"{path}: replaced while it was read (another process is writing it)")
        handle.seek(0)
        size = struct.unpack("<Q", handle.read(8))[0]
        if size > MAX_HEADER_BYTES:  # the library refuses it too; never read it
            raise ValueError(f"a header of {size} bytes, over the {MAX_HEADER_BYTES} the format allows")
        header = json.loads(handle.read(size), object_pairs_hook=_unique_keys)
    except (SafetensorError, OSError, struct.error, ValueError, RecursionError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err}); is it truncated?") from None
    for name, (dtype, _) in seen.items():
        if dtype not in READ_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype}, which moespec cannot read into a "
                                  f"model; it reads {', '.join(READ_DTYPES)}")
    start = 8 + size
    if not isinstance(header, dict) or not _tiles(header, seen, os.fstat(handle.fileno()).st_size - start):
        raise CheckpointError(f"{path}: its header does not say what the safetensors library read from it; "
                              f"not a valid safetensors file")
    header["__metadata__"] = metadata
    return header, start


def _still_at(path: Path, handle: BinaryIO) -> bool:
    """Whether `path` still leads to the open file `handle` (writers replace files, never rewrite them)."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(handle.fileno()))
    except OSError:
        return False


def read_safetensors_header(path: str | Path) -> tuple[dict, int]:
    """The validated JSON header of a safetensors file and the byte offset where its data starts
    (`open_safetensors`)."""
    with open_safetensors(path) as file:
        return file.header, file.start


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


def read_safetensors_into(source: str | Path | SafetensorsFile, targets: Mapping[str, torch.Tensor],
                          rows: Mapping[str, slice] | None = None) -> None:
    """Read each tensor of a safetensors file (a path, or one held open) straight into `targets[name]`'s storage
    (cast if the dtypes differ), with plain reads rather than a memory map: memory holds the targets plus at
    most one tensor. The offsets come from a header the safetensors library validated (`open_safetensors`).
    A tensor named in `rows` is read only for those rows (a slice of its first axis, such as one rank's
    experts), one contiguous run of bytes."""
    if not isinstance(source, SafetensorsFile):
        with open_safetensors(source) as opened:
            read_safetensors_into(opened, targets, rows)
        return
    path, header, start, f = source.path, source.header, source.start, source.handle
    rows = rows or {}
    with torch.no_grad():
        for name, entry in header.items():
            if name == "__metadata__" or name not in targets:
                continue
            target, dtype, (begin, end) = targets[name], READ_DTYPES[entry["dtype"]], entry["data_offsets"]
            shape = list(entry["shape"])
            if name in rows:
                begin, end, shape = _row_span(path, name, shape, begin, end, rows[name])
            if tuple(target.shape) != tuple(shape):
                raise CheckpointError(f"{path}: {name} is {tuple(shape)} in the file but "
                                      f"{tuple(target.shape)} in the model")
            check_castable(path, name, entry["dtype"], target.dtype)
            same = target.dtype == dtype and target.is_contiguous() and target.device.type == "cpu"
            buffer = target if same else torch.empty(shape, dtype=dtype)
            f.seek(start + begin)
            if f.readinto(memoryview(buffer.reshape(-1).view(torch.uint8).numpy())) != end - begin:
                raise CheckpointError(f"{path}: {name} is cut short; is the file truncated?")
            if not same:
                target.copy_(buffer)


def _row_span(path: Path, name: str, shape: list[int], begin: int, end: int, rows: slice
              ) -> tuple[int, int, list[int]]:
    """The byte span and shape of rows `rows` (a step-1 slice of the first axis) of a tensor at [begin, end)."""
    if not shape or rows.step not in (None, 1) or not 0 <= rows.start <= rows.stop <= shape[0]:
        raise CheckpointError(f"{path}: {name} is {tuple(shape)} in the file; it has no rows "
                              f"{rows.start}:{rows.stop} to read")
    row_bytes = (end - begin) // shape[0] if shape[0] else 0
    return begin + rows.start * row_bytes, begin + rows.stop * row_bytes, [rows.stop - rows.start, *shape[1:]]


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



"""The safetensors format, read and written tensor by tensor: headers checked against the file size, reads
straight into a model's tensors, writes that stream one tensor at a time."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from ..errors import CheckpointError

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}

DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The precisions a checkpoint may be written in, by the names the CLI takes (`--dtype bf16`)."""


def read_safetensors_header(path: str | Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file (name -> dtype, shape, data_offsets; "__metadata__") and the byte
    offset where the data starts. Every tensor's bytes are checked to lie inside the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            if size > path.stat().st_size:
                raise ValueError("header length beyond the end of the file")
            header = json.loads(f.read(size))
        start, end = 8 + size, path.stat().st_size
        for name, entry in header.items():
            if name != "__metadata__" and start + entry["data_offsets"][1] > end:
                raise ValueError(f"{name} ends beyond the end of the file")
    except (OSError, struct.error, ValueError, KeyError, TypeError, IndexError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(err).__name__}: {err}); "
                              f"is it truncated?") from None
    return header, start


def read_safetensors_into(path: str | Path, targets: Mapping[str, torch.Tensor]) -> None:
    """Read each tensor of a safetensors file straight into `targets[name]`'s storage (cast if the dtypes
    differ), with plain reads rather than a memory map: memory holds the targets plus at most one tensor."""
    header, start = read_safetensors_header(path)
    dtypes = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    with open(path, "rb") as f, torch.no_grad():
        for name, entry in header.items():
            if name == "__metadata__" or name not in targets:
                continue
            target, (begin, end) = targets[name], entry["data_offsets"]
            same = target.dtype == dtypes[entry["dtype"]] and target.is_contiguous() and target.device.type == "cpu"
            buffer = target if same else torch.empty(entry["shape"], dtype=dtypes[entry["dtype"]])
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



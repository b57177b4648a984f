"""Google vmoe's own checkpoints (`vmoe.checkpoints.partitioned`, the format of the released V-MoE weights):
`PREFIX.index` and the shards `PREFIX.data-00000-of-0000N`, msgpack with flax's and vmoe's extension types.

    PREFIX.index      {"shard_count": N, "index": tree of IndexInfo, "version": "20220622"}   (no "version" before
                      vmoe's 2022-06-22 layout, which the 2022-01 V-MoE releases use; the same bytes otherwise)
    IndexInfo         (global shape and dtype, the global slices of the array's chunks, the shard of each chunk)
    PREFIX.data-i     {"__msgpack_array_chunk_a87ca2__": true, "LEAF": [[subchunks, global slice], ...], ...}
                      LEAF: the array's place in the index tree flattened with sorted keys (jax's order); each
                      chunk is its flat subchunks (flax ndarrays) and the slice of the array it fills

Only the extension types of arrays, slices and index entries are decoded (shapes, dtype names, raw bytes), and
nothing else: no pickle, no code from the file. The shard names are built from the prefix and the index's shard
count, never read from a file. The data is read tensor by tensor: a first pass over each shard reads only its
msgpack headers (where each chunk lies), then each tensor is assembled from its chunks, their values read straight
from the file into it, so memory is bounded by the largest tensor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import msgpack
import numpy as np

from ..errors import CheckpointError
from .sharding import not_a_file

VERSIONS = (None, "20220622")
"""The index layouts read: vmoe's before 2022-06-22 (no version), and its "V1"."""
MAX_INDEX_BYTES = 64 << 20
"""An index lists shapes and slices: a few hundred kB for the largest released V-MoE; more is not an index."""
MAX_SHARDS = 100_000
MAGIC = "__msgpack_array_chunk_a87ca2__"
EXT_NDARRAY, EXT_SLICE_ND, EXT_INDEX_INFO = 1, 6, 8
DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64, "bfloat16": np.uint16,
          "int32": np.int32, "int64": np.int64, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_}
"""The array dtypes read (bfloat16 as its bits, widened to float32 when read)."""

Slices = tuple[tuple[int, int], ...]


@dataclass
class TensorEntry:
    """One array of the index: its shape, dtype, and where its chunks are."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    slices: list[Slices]
    shards: list[int]
    found: list[tuple[Path, list[tuple[int, int]]] | None] = field(default_factory=list)
    """Per chunk: its shard file and the byte spans of its subchunks there (filled by the scan)."""


class LegacyCheckpoint:
    """The index of a vmoe checkpoint at `prefix`, and its tensors read one at a time (`tensors`)."""

    def __init__(self, prefix: str | Path):
        self.prefix = Path(prefix)
        self.index = Path(f"{self.prefix}.index")
        data = _read_index_bytes(self.index)
        try:
            content = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_index_hook)
        except (ValueError, TypeError, msgpack.UnpackException, _Refused) as err:
            raise CheckpointError(f"{self.index}: not a vmoe checkpoint index ({_one_line(err)})") from None
        if not isinstance(content, dict) or not isinstance(content.get("index"), dict):
            raise CheckpointError(f"{self.index}: not a vmoe checkpoint index (no 'index' tree)")
        self.version = content.get("version")
        if self.version not in VERSIONS:
            raise CheckpointError(f"{self.index}: vmoe index version {self.version!r}; moespec reads "
                                  f"{', '.join(repr(v) for v in VERSIONS)}")
        count = content.get("shard_count")
        if type(count) is not int or not 1 <= count <= MAX_SHARDS:
            raise CheckpointError(f"{self.index}: shard_count {count!r} is not a number of shards "
                                  f"(1 to {MAX_SHARDS:,})")
        self.shard_files = [self.prefix.with_name(f"{self.prefix.name}.data-{i:05d}-of-{count:05d}")
                            for i in range(count)]
        self.entries = [self._entry(name, info) for name, info in _flatten(content["index"])]
        self.tensors_by_name = {entry.name: entry for entry in self.entries}

    def _entry(self, name: str, info: Any) -> TensorEntry:
        if not isinstance(info, tuple) or len(info) != 3:
            raise CheckpointError(f"{self.index}: {name}: not an array entry of a vmoe index")
        (shape, dtype), slices, shards = info
        if dtype not in DTYPES:
            raise CheckpointError(f"{self.index}: {name}: dtype {dtype!r} is not one moespec reads "
                                  f"({', '.join(DTYPES)})")
        if len(slices) != len(shards) or not slices:
            raise CheckpointError(f"{self.index}: {name}: {len(slices)} chunks but {len(shards)} shards")
        for chunk, shard in zip(slices, shards, strict=True):
            if type(shard) is not int or not 0 <= shard < len(self.shard_files):
                raise CheckpointError(f"{self.index}: {name}: names shard {shard!r}, outside the "
                                      f"{len(self.shard_files)} shards of this checkpoint "
                                      f"({self.prefix.name}.data-*-of-{len(self.shard_files):05d} in its folder)")
            fits = len(chunk) == len(shape) and all(0 <= a < b <= n for (a, b), n in zip(chunk, shape, strict=True))
            if not fits:
                raise CheckpointError(f"{self.index}: {name}: chunk {_show(chunk)} does not fit its shape "
                                      f"{list(shape)}")
        if sum(_size(chunk) for chunk in slices) != _size(tuple((0, n) for n in shape)) or _overlap(slices):
            raise CheckpointError(f"{self.index}: {name}: its chunks do not tile its shape {list(shape)}")
        return TensorEntry(name, tuple(shape), dtype, list(slices), list(shards), [None] * len(slices))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {entry.name: entry.shape for entry in self.entries}

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Each tensor, whole, in index order: (tree name, array in its own dtype; bfloat16 as float32)."""
        for shard, file in enumerate(self.shard_files):
            if any(shard in entry.shards for entry in self.entries):
                self._scan(shard, file)
        for entry in self.entries:
            missing = [i for i, where in enumerate(entry.found) if where is None]
            if missing:
                shard = self.shard_files[entry.shards[missing[0]]]
                raise CheckpointError(f"{shard}: has no chunk {_show(entry.slices[missing[0]])} of {entry.name}, "
                                      f"which the index puts there")
            yield entry.name, self._assemble(entry)

    def _scan(self, shard: int, file: Path) -> None:
        """Note where each chunk of `file` lies, holding one chunk at a time."""
        by_leaf = {str(i): entry for i, entry in enumerate(self.entries)}
        what = not_a_file(file)
        if what is not None:
            needed = next(entry.name for entry in self.entries if shard in entry.shards)
            raise CheckpointError(f"{file}: {what}: the shard {shard} of "
                                  f"{self.index}, which holds {needed}")
        entry = None
        with open(file, "rb") as f:
            stream = _Stream(f, os.fstat(f.fileno()).st_size)
            try:
                for _ in range(stream.header(MAP_HEADERS)):
                    key = stream.string()
                    if key == MAGIC:
                        stream.take(1)  # true
                        continue
                    entry = by_leaf.get(key)
                    if entry is None:
                        raise CheckpointError(f"{file}: holds array {key!r}, which {self.index} does not list")
                    for _ in range(stream.header(ARRAY_HEADERS)):
                        if stream.header(ARRAY_HEADERS) != 2:
                            raise CheckpointError(f"{file}: {entry.name}: a chunk is not [subchunks, slice]")
                        spans = [stream.ext(EXT_NDARRAY) for _ in range(stream.header(ARRAY_HEADERS))]
                        start, end = stream.ext(EXT_SLICE_ND)
                        f.seek(start)
                        chunk = _slice_nd(stream.take(end - start))
                        if chunk not in entry.slices or entry.shards[entry.slices.index(chunk)] != shard:
                            raise CheckpointError(f"{file}: {entry.name}: holds chunk {_show(chunk)}, which the "
                                                  f"index does not put in this shard")
                        entry.found[entry.slices.index(chunk)] = (file, spans)
            except msgpack.OutOfData:
                inside = f" inside {entry.name}" if entry is not None else ""
                raise CheckpointError(f"{file}: truncated: the file ends{inside} "
                                      f"({stream.size:,} bytes)") from None
            except (ValueError, TypeError, KeyError, msgpack.UnpackException, _Refused) as err:
                inside = f" {entry.name}:" if entry is not None else ""
                raise CheckpointError(f"{file}:{inside} not a vmoe checkpoint shard ({_one_line(err)})") from None

    def _assemble(self, entry: TensorEntry) -> np.ndarray:
        """The tensor of `entry`, its chunks' bytes read straight into it where a chunk is contiguous in it."""
        out = np.empty(entry.shape, dtype=DTYPES[entry.dtype])
        for chunk, (file, spans) in zip(entry.slices, entry.found, strict=True):
            region = out[tuple(slice(a, b) for a, b in chunk)]
            flat = region.reshape(-1) if region.flags.c_contiguous else np.empty(region.size, out.dtype)
            filled = 0
            with open(file, "rb") as f:
                for start, end in spans:
                    filled += _read_into(f, start, end, flat[filled:], file, entry)
            if filled != flat.size:
                raise CheckpointError(f"{file}: {entry.name}: chunk {_show(chunk)} holds {filled:,} values, not "
                                      f"the {flat.size:,} of shape {list(region.shape)}")
            if not region.flags.c_contiguous:
                region[...] = flat.reshape(region.shape)
        if entry.dtype == "bfloat16":  # its bits are the high half of a float32's
            return (out.astype(np.uint32) << 16).view(np.float32)
        return out


class _Refused(ValueError):
    """An extension type that is not an array, a slice or an index entry."""


def _index_hook(code: int, data: bytes) -> Any:
    if code != EXT_INDEX_INFO:
        raise _Refused(f"extension type {code} in an index")
    shape_bytes, slices, shards = msgpack.unpackb(data, raw=True)
    shape, dtype, _, _ = msgpack.unpackb(shape_bytes, raw=True)
    if not isinstance(shape, (list, tuple)) or not all(type(n) is int and n >= 0 for n in shape):
        raise _Refused(f"shape {shape!r}")
    return (tuple(shape), dtype.decode() if isinstance(dtype, bytes) else dtype), [_slice_nd(s) for s in slices], \
        list(shards)


def _slice_nd(data: bytes) -> Slices:
    slices = []
    for one in msgpack.unpackb(data, raw=True):
        start, stop, step = msgpack.unpackb(one, raw=True)
        if type(start) is not int or type(stop) is not int or step not in (None, 1):
            raise _Refused(f"slice {(start, stop, step)!r}")
        slices.append((start, stop))
    return tuple(slices)


def _read_into(f: BinaryIO, start: int, end: int, into: np.ndarray, file: Path, entry: TensorEntry) -> int:
    """Read the flax ndarray extension at bytes [start, end) of `f` (shape, dtype name, raw bytes) into the start
    of `into`; returns the values read. Only its header is parsed in Python: the values go straight from the file."""
    f.seek(start)
    head = f.read(min(end - start, HEADER_BYTES))
    try:
        code, payload = _header(head, EXT_HEADERS)
        unpacker = msgpack.Unpacker(raw=True)
        unpacker.feed(head[payload:])
        if unpacker.read_array_header() != 3:
            raise ValueError("not (shape, dtype, bytes)")
        shape, dtype = unpacker.unpack(), unpacker.unpack()
        length, data = _header(head[payload + unpacker.tell():], BIN_HEADERS)
        data += payload + unpacker.tell()
    except (ValueError, TypeError, IndexError, KeyError, msgpack.UnpackException) as err:
        raise CheckpointError(f"{file}: {entry.name}: not an array chunk ({_one_line(err)})") from None
    dtype = dtype.decode() if isinstance(dtype, bytes) else dtype
    if code != EXT_NDARRAY or dtype != entry.dtype:
        raise CheckpointError(f"{file}: {entry.name}: a chunk of dtype {dtype!r}, the index says {entry.dtype!r}")
    count = length // into.itemsize
    if length % into.itemsize or count != int(np.prod(shape)) or start + data + length != end:
        raise CheckpointError(f"{file}: {entry.name}: a subchunk of shape {list(shape)} with {length:,} bytes")
    if count > into.size:
        raise CheckpointError(f"{file}: {entry.name}: its chunks hold more values than its shape {list(entry.shape)}")
    f.seek(start + data)
    if f.readinto(memoryview(into[:count]).cast("B")) != length:
        raise CheckpointError(f"{file}: truncated inside {entry.name} (it changed while read)")
    return count


HEADER_BYTES = 4096
"""An array's header: the extension's, (shape, dtype name) and the bin's: a few dozen bytes."""
EXT_HEADERS = {0xD4: (1, 1), 0xD5: (2, 1), 0xD6: (4, 1), 0xD7: (8, 1), 0xD8: (16, 1), 0xC7: (0, 1), 0xC8: (0, 2),
               0xC9: (0, 4)}
"""msgpack's extension formats: first byte -> (fixed length or 0, bytes of the length field)."""
BIN_HEADERS = {0xC4: (0, 1), 0xC5: (0, 2), 0xC6: (0, 4)}
MAP_HEADERS = {**{0x80 + n: (n, 0) for n in range(16)}, 0xDE: (0, 2), 0xDF: (0, 4)}
ARRAY_HEADERS = {**{0x90 + n: (n, 0) for n in range(16)}, 0xDC: (0, 2), 0xDD: (0, 4)}
STR_HEADERS = {**{0xA0 + n: (n, 0) for n in range(32)}, 0xD9: (0, 1), 0xDA: (0, 2), 0xDB: (0, 4)}


class _Stream:
    """The msgpack headers of a shard, read from the file a few bytes at a time; an array's bytes are skipped, so
    the scan holds no chunk. The end of the file inside an object is msgpack's OutOfData."""

    def __init__(self, f: BinaryIO, size: int):
        self.f, self.size = f, size

    def take(self, count: int) -> bytes:
        data = self.f.read(count)
        if len(data) != count:
            raise msgpack.OutOfData()
        return data

    def header(self, formats: dict[int, tuple[int, int]]) -> int:
        """A map's or array's entries, or a str's length."""
        first = self.take(1)[0]
        if first not in formats:
            raise ValueError(f"byte 0x{first:02x} at {self.f.tell() - 1:,} where the shard's layout has another type")
        fixed, size = formats[first]
        return int.from_bytes(self.take(size), "big") if size else fixed

    def string(self) -> str:
        return self.take(self.header(STR_HEADERS)).decode()

    def ext(self, code: int) -> tuple[int, int]:
        """The byte span of the next extension object, of type `code` (its payload for a slice), skipped."""
        start = self.f.tell()
        first = self.take(1)[0]
        if first not in EXT_HEADERS:
            raise ValueError(f"byte 0x{first:02x} at {start:,} where an extension object belongs")
        fixed, size = EXT_HEADERS[first]
        length = int.from_bytes(self.take(size), "big") if size else fixed
        if self.take(1)[0] != code:
            raise _Refused(f"an extension object of another type at {start:,}")
        payload = self.f.tell()
        if payload + length > self.size:
            raise msgpack.OutOfData()
        self.f.seek(payload + length)
        return (payload, payload + length) if code == EXT_SLICE_ND else (start, payload + length)


def _header(raw: bytes, formats: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """For an extension: (its type, where its payload starts); for a bin: (its length, where its bytes start)."""
    fixed, size = formats[raw[0]]
    length = fixed or int.from_bytes(raw[1:1 + size], "big")
    if formats is EXT_HEADERS:
        at = 1 + (0 if fixed else size)
        return raw[at], at + 1
    return length, 1 + size


def _flatten(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(name, leaf) in jax's order: dict keys sorted, names joined with '/'."""
    for key in sorted(tree):
        value = tree[key]
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, name + "/")
        else:
            yield name, value


def _read_index_bytes(index: Path) -> bytes:
    what = not_a_file(index)
    if what is not None:
        raise CheckpointError(f"{index}: no such vmoe checkpoint index" if what == "missing" else
                              f"{index}: not a vmoe checkpoint index ({what})")
    with open(index, "rb") as f:
        data = f.read(MAX_INDEX_BYTES + 1)
    if len(data) > MAX_INDEX_BYTES:
        raise CheckpointError(f"{index}: more than {MAX_INDEX_BYTES:,} bytes, more than a vmoe index can be; not read")
    return data





def _size(chunk: Slices) -> int:
    return int(np.prod([b - a for a, b in chunk], dtype=np.int64)) if chunk else 1


def _overlap(slices: list[Slices]) -> bool:
    return any(all(max(a[0], b[0]) < min(a[1], b[1]) for a, b in zip(x, y, strict=True)) and x
               for i, x in enumerate(slices) for y in slices[i + 1:])


def _show(chunk: Slices) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in chunk) + "]"


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())[:200]

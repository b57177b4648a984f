"""Fuzzing the readers of safetensors files and shard indexes with mutated headers (length prefix, JSON bytes,
types), offsets, dtypes, shapes and index files. Every input either raises CheckpointError (nothing else,
and promptly) or loads exactly what the safetensors library loads (`safetensors.torch.load_file`, the oracle:
same names, dtypes and bytes). Budget: the "ci" profile by default, MOESPEC_FUZZ=long explores more."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from moespec.errors import CheckpointError
from moespec.io import READ_DTYPES, checkpoint_files, read_safetensors_header, read_safetensors_into

BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
        "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64,
        "I64": 64, "U64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
"""Bits per value of every dtype the safetensors format names: to write files the library accepts."""
DTYPES = [*BITS, "C128", "f32", "F32 ", "", "X"]
NAMES = st.text(alphabet="ab._é\x00\"\\", max_size=3) | st.sampled_from(["__metadata__", "a" * 40])
SIZES = st.integers(-3, 3) | st.sampled_from([2**31, 2**63 - 1, 2**64, -(2**63)])
JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=3),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                max_size=3), max_leaves=6)
PROMPT = settings(deadline=None)  # no wall-clock bound (a busy machine fails one); the files are a few bytes


@st.composite
def valid_files(draw):
    """(header, data) of a file the library accepts: tensors laid end to end, in a random order."""
    tensors = []
    for name in draw(st.lists(NAMES.filter(lambda n: n != "__metadata__"), min_size=1, max_size=3, unique=True)):
        dtype = draw(st.sampled_from(list(BITS)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        if math.prod(shape) * BITS[dtype] % 8:
            shape = [*shape, 0] if shape else [0]  # packed dtypes fill whole bytes
        tensors.append((name, dtype, shape, math.prod(shape) * BITS[dtype] // 8))
    header, offset = {}, 0
    for name, dtype, shape, size in draw(st.permutations(tensors)):
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2))
    data = draw(st.binary(min_size=offset, max_size=offset))
    return dict(draw(st.permutations(list(header.items())))), data


MUTATIONS = ["dtype", "shape", "offsets", "entry", "metadata", "add", "json", "twice", "spaces", "length", "bytes",
             "cut"]


@st.composite
def mutated_files(draw):
    """The bytes of a valid file (a third of the time), or one with up to 3 mutations: to its header's
    values, its JSON text, its length prefix or its bytes."""
    header, data = draw(valid_files())
    tensors = [name for name in header if name != "__metadata__"]
    mutations = draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3)) if draw(st.integers(0, 2)) else []
    for kind in mutations:
        name = draw(st.sampled_from(tensors)) if tensors else None
        entry = header.get(name) if isinstance(header.get(name), dict) else {}
        if kind == "dtype":
            entry["dtype"] = draw(st.sampled_from(DTYPES) | JSON)
        elif kind == "shape":
            entry["shape"] = draw(st.lists(SIZES, max_size=3) | JSON)
        elif kind == "offsets":
            other = header.get(draw(st.sampled_from(tensors))) if tensors else None
            other = other.get("data_offsets") if isinstance(other, dict) else None
            same = list(other) if isinstance(other, list) else [0, 0]  # another tensor's offsets: an alias
            entry["data_offsets"] = draw(st.just(same) | st.lists(SIZES, min_size=2, max_size=2)
                                         | st.lists(st.integers(0, len(data) + 2), max_size=3) | JSON)
        elif kind == "entry" and name is not None:
            header[name] = draw(JSON)
        elif kind == "metadata":
            header["__metadata__"] = draw(JSON)
        elif kind == "add":
            header[draw(NAMES)] = draw(JSON)
    text = json.dumps(header).encode() if "json" not in mutations else draw(JSON.map(json.dumps)).encode()
    if "twice" in mutations and tensors:  # a name given twice
        text = text[:-1] + b"," + json.dumps({tensors[0]: header[tensors[0]]}).encode()[1:]
    if "spaces" in mutations:
        text = draw(st.sampled_from([b" ", b"\n", b""])) + text + draw(st.sampled_from([b" ", b"\x00", b"}", b""]))
    length = len(text)
    if "length" in mutations:
        length = draw(st.integers(0, 2**64 - 1) | st.integers(max(0, length - 8), length + 8))
    raw = bytearray(length.to_bytes(8, "little") + text + data)
    if "bytes" in mutations:
        for _ in range(draw(st.integers(1, 3))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    if "cut" in mutations:  # cut short, or with bytes after the data
        raw = raw[:draw(st.integers(0, len(raw)))] + draw(st.sampled_from([b"", b"\x00", b"\x00" * 8]))
    return bytes(raw)


def _read(path: Path) -> dict[str, torch.Tensor]:
    """What moespec reads: each tensor straight into a tensor of the file's own dtype and shape."""
    header, _ = read_safetensors_header(path)
    targets = {name: torch.full(entry["shape"], 7).to(READ_DTYPES[entry["dtype"]])
               for name, entry in header.items() if name != "__metadata__"}
    read_safetensors_into(path, targets)
    return targets


def _library(path: Path) -> dict[str, torch.Tensor] | None:
    try:
        return load_file(str(path))
    except Exception:  # noqa: BLE001 - the oracle refusing, for whatever reason, is the fact we compare with
        return None


def _same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> bool:
    return ours.keys() == theirs.keys() and all(
        ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape
        and torch.equal(ours[k].reshape(-1).view(torch.uint8), theirs[k].reshape(-1).view(torch.uint8))
        for k in ours)


SHARDS = {"model-1.safetensors": {"a": torch.arange(3.0), "b": torch.ones(2, dtype=torch.int64)},
          "model-2.safetensors": {"c": torch.zeros(1, dtype=torch.bfloat16)}}
OUTSIDE = "outside.safetensors"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Shards `SHARDS` in `folder`, and a file `OUTSIDE` next to it (a copy of the second shard)."""
    root = tmp_path_factory.mktemp("fuzz")
    save_file(SHARDS["model-2.safetensors"], str(root / OUTSIDE))
    (root / "ckpt").mkdir()
    for file, tensors in SHARDS.items():
        save_file(tensors, str(root / "ckpt" / file))
    return root / "ckpt"


@PROMPT
@given(blob=mutated_files())
def test_a_file_is_refused_or_read_exactly_as_the_safetensors_library_reads_it(blob, folder):
    path = folder.parent / "fuzz.safetensors"
    path.write_bytes(blob)
    theirs = _library(path)
    try:
        ours = _read(path)
    except CheckpointError as refused:
        event("refused", "the library too" if theirs is None else "the library reads it")
        assert theirs is None or "appears twice" in str(refused) or "cannot read into a model" in str(refused), \
            f"refused a file the library reads: {refused}"
        return
    event("read", f"{len(ours)} tensor(s)")
    assert theirs is not None, "read a file the safetensors library refuses"
    assert _same(ours, theirs)


PLACES = st.sampled_from([*SHARDS, f"../{OUTSIDE}", "ABSOLUTE", "missing.safetensors", "", ".", "..", "sub/x",
                          "model-1.safetensors/", "model-1.safetensors\x00"]) | JSON


@st.composite
def index_texts(draw):
    """A shard index: the true one with mutated entries, metadata or shape, or text cut or garbled."""
    weight_map = {name: file for file, tensors in SHARDS.items() for name in tensors}
    for _ in range(draw(st.integers(0, 3)) if draw(st.booleans()) else 0):
        weight_map[draw(st.sampled_from(["a", "b", "c", "d", ""]))] = draw(PLACES)
    for name in draw(st.lists(st.sampled_from(list(weight_map)), max_size=2)) if draw(st.booleans()) else []:
        weight_map.pop(name, None)
    content = {"metadata": draw(st.just({"total_size": 22}) | JSON), "weight_map": weight_map}
    text = json.dumps(content if draw(st.integers(0, 4)) else draw(st.just({"weight_map": weight_map}) | JSON))
    if draw(st.integers(0, 5)) == 0:
        text = text[:draw(st.integers(0, len(text)))]
    return text if draw(st.integers(0, 9)) else "[" * 5000 + "]" * 5000


@PROMPT
@given(text=index_texts())
def test_an_index_is_refused_or_names_shards_next_to_it_that_hold_exactly_its_weight_map(text, folder):
    index = folder / "model.safetensors.index.json"
    index.write_text(text.replace('"ABSOLUTE"', json.dumps(str(folder.parent / OUTSIDE))))
    try:
        metadata, files = checkpoint_files(index)
    except CheckpointError:
        event("refused")
        return
    event("read")
    weight_map = json.loads(index.read_text())["weight_map"]
    assert all(f.parent == folder and f.name in SHARDS for f in files)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    held = {name: file.name for file in files for name in load_file(str(file))}
    assert held == weight_map

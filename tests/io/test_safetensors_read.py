"""Reading safetensors: the safetensors library validates every file before a byte of data is read, every dtype
that safetensors and torch share loads (cast into the model's), and whatever is refused is a CheckpointError
that names the file and the tensor."""

from __future__ import annotations

import tracemalloc

import pytest
import torch
from safetensors.torch import load_file, save_file

from moespec.errors import CheckpointError
from moespec.io import checkpoint_files, read_safetensors_header, read_safetensors_into

from .raw_files import entry, raw_file

HEADER_CAP = 100_000_000  # the safetensors library's MAX_HEADER_SIZE


def test_negative_offsets_never_load_header_bytes_as_weights(tmp_path):
    path = raw_file(tmp_path / "neg.safetensors", {"w": entry("U8", [8], -8, 0)})
    target = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="neg.safetensors: not a readable safetensors file"):
        read_safetensors_into(path, {"w": target})
    assert not target.any()


def test_overlapping_offsets_never_alias_two_tensors(tmp_path):
    data = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    header = {"a": entry("F32", [4], 0, 16), "b": entry("F32", [4], 0, 16)}
    path = raw_file(tmp_path / "alias.safetensors", header, data)
    with pytest.raises(CheckpointError, match="alias.safetensors: not a readable safetensors file"):
        read_safetensors_into(path, {"a": torch.zeros(4), "b": torch.zeros(4)})


def test_a_header_over_the_format_cap_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:  # sparse: a header length just over the cap, and that many bytes of zeros
        f.write((HEADER_CAP + 1).to_bytes(8, "little"))
        f.truncate(8 + HEADER_CAP + 1)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="huge.safetensors: not a readable safetensors file"):
            read_safetensors_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10**6


CASTABLE = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U16": torch.uint16,
            "U32": torch.uint32, "U64": torch.uint64, "F64": torch.float64, "I16": torch.int16}


@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16])
def test_every_dtype_safetensors_and_torch_share_loads_cast_into_the_models(tmp_path, target):
    values = torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, 8.0]])
    path = tmp_path / "dtypes.safetensors"
    save_file({name: values.to(dtype) for name, dtype in CASTABLE.items()}, str(path))
    targets = {name: torch.full((2, 3), -1.0, dtype=target) for name in CASTABLE}
    read_safetensors_into(path, targets)
    for name, tensor in load_file(str(path)).items():
        assert torch.equal(targets[name], tensor.to(target)), name
        assert torch.equal(targets[name], values.to(target)), name


@pytest.mark.parametrize(("dtype", "values", "size"), [("F4", 2, 1), ("F6_E2M3", 4, 3)])  # packed: 4 or 6 bits
def test_a_dtype_torch_cannot_cast_is_refused_naming_file_tensor_and_dtype(tmp_path, dtype, values, size):
    header = {"w": entry(dtype, [values], 0, size), "ok": entry("U8", [1], size, size + 1)}
    path = raw_file(tmp_path / "packed.safetensors", header, bytes(size + 1))
    with pytest.raises(CheckpointError, match=f"packed.safetensors: tensor 'w' has dtype {dtype}, which moespec "
                                              f"cannot read.*it reads F64, F32"):
        read_safetensors_into(path, {"w": torch.zeros(values), "ok": torch.zeros(1)})


def test_complex_weights_are_not_silently_made_real(tmp_path):
    path = tmp_path / "complex.safetensors"
    save_file({"w": torch.tensor([1 + 2j], dtype=torch.complex64)}, str(path))
    with pytest.raises(CheckpointError, match="complex.safetensors: tensor 'w' is complex.*imaginary"):
        read_safetensors_into(path, {"w": torch.zeros(1)})
    into_complex = {"w": torch.zeros(1, dtype=torch.complex64)}
    read_safetensors_into(path, into_complex)
    assert into_complex["w"].item() == 1 + 2j


ONE_BYTE = entry("U8", [1], 0, 1)


@pytest.mark.parametrize("header", [[], [{"w": ONE_BYTE}], {"__metadata__": "spec", "w": ONE_BYTE},
                                    {"__metadata__": ["a"], "w": ONE_BYTE}, {"__metadata__": {"k": 3}, "w": ONE_BYTE}])
def test_a_header_or_metadata_of_the_wrong_shape_is_refused(tmp_path, header):
    path = raw_file(tmp_path / "odd.safetensors", header, b"\x00")
    with pytest.raises(CheckpointError, match="odd.safetensors: not a readable safetensors file"):
        checkpoint_files(path)


def test_a_tensor_named_twice_is_refused(tmp_path):
    text = '{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "w": {"dtype": "U8", "shape": [1], ' \
           '"data_offsets": [0, 1]}}'
    path = raw_file(tmp_path / "twice.safetensors", None, b"\x07", text=text)
    with pytest.raises(CheckpointError, match="twice.safetensors: .*a name appears twice"):
        read_safetensors_header(path)

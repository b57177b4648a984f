"""Orbax checkpoints (orbax-checkpoint's `StandardCheckpointer`, what vmoe's trainer writes since 2023): a folder with
`_METADATA` (the tree: each array's key path and shape) and the arrays as zarr in an OCDBT database
(`manifest.ocdbt`, `d/`, `ocdbt.process_N/`), read with TensorStore, Google's own reader of that format.

TensorStore is an optional dependency (`pip install 'moespec[vmoe]'`), imported only when an Orbax folder is read.
Before it opens anything, every entry of the folder must be a plain file or folder (no link out of it); its file
driver refuses keys with `..` components, so the data files an OCDBT manifest names stay inside the folder.
Each array is read on its own, with TensorStore's cache off: memory is bounded by the largest tensor.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..errors import CheckpointError
from .sharding import read_json

METADATA = "_METADATA"
MANIFEST = "manifest.ocdbt"
ARRAY_TYPES = ("jax.Array", "np.ndarray")
INSTALL = "pip install 'moespec[vmoe]'"


def is_orbax(path: str | Path) -> bool:
    """Whether `path` is a folder that holds an Orbax checkpoint's `_METADATA`."""
    return Path(path).is_dir() and (Path(path) / METADATA).exists()


class OrbaxCheckpoint:
    """The tree of an Orbax checkpoint folder and its arrays, read one at a time (`tensors`)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.index = self.folder / METADATA
        _check_folder(self.folder)
        try:
            metadata = read_json(self.index, "an Orbax checkpoint's _METADATA")
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{self.index}: not an Orbax checkpoint's metadata ({err})") from None
        tree = metadata.get("tree_metadata") if isinstance(metadata, dict) else None
        if not isinstance(tree, dict):
            raise CheckpointError(f"{self.index}: no tree_metadata; not an Orbax checkpoint of arrays")
        if not metadata.get("use_ocdbt", False):
            raise CheckpointError(f"{self.index}: an Orbax checkpoint without OCDBT; moespec reads OCDBT ones (Orbax's "
                                  f"default since 0.5)")
        if not (self.folder / MANIFEST).is_file():
            raise CheckpointError(f"{self.folder / MANIFEST}: missing; the OCDBT database of {self.folder} is "
                                  f"incomplete")
        self.zarr = "zarr3" if metadata.get("use_zarr3") else "zarr"
        self.arrays = dict(_arrays(self.index, tree))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (_, shape) in self.arrays.items()}

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Each array, whole: (tree name, array in its own dtype; bfloat16 as float32)."""
        ts = _tensorstore()
        context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
        base = {"driver": "file", "path": str(self.folder.resolve()) + "/"}
        for name, (key, shape) in self.arrays.items():
            spec = {"driver": self.zarr, "kvstore": {"driver": "ocdbt", "base": base, "path": key + "/"}, "open": True}
            try:
                store = ts.open(spec, context=context, read=True).result()
                if tuple(store.shape) != shape:
                    raise CheckpointError(f"{self.folder}: {name}: its array is {list(store.shape)}, the metadata "
                                          f"says {list(shape)}")
                array = np.asarray(store.read().result())
            except CheckpointError:
                raise
            except Exception as err:  # TensorStore's errors are ValueErrors with the path and the cause
                raise CheckpointError(f"{self.folder}: {name}: could not be read ({' '.join(str(err).split())[:300]})"
                                      ) from None
            if array.dtype.name == "bfloat16":
                array = array.astype(np.float32)
            yield name, array


def _arrays(index: Path, tree: dict) -> Iterator[tuple[str, tuple[str, tuple[int, ...]]]]:
    """(name joined with '/', (the array's key in the database, shape)) of each leaf of `_METADATA`."""
    for entry in tree.values():
        keys = [k.get("key") for k in entry.get("key_metadata", [])] if isinstance(entry, dict) else []
        value = entry.get("value_metadata", {}) if isinstance(entry, dict) else {}
        if not keys or not all(isinstance(k, str) and k and "/" not in k and k not in (".", "..") for k in keys):
            raise CheckpointError(f"{index}: a tree entry with key path {keys!r}; not an Orbax tree of named arrays")
        name = "/".join(keys)
        if value.get("value_type") not in ARRAY_TYPES:
            raise CheckpointError(f"{index}: {name}: a {value.get('value_type')!r}, not an array")
        shape = value.get("write_shape")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise CheckpointError(f"{index}: {name}: shape {shape!r}")
        yield name, (".".join(keys), tuple(shape))


def _check_folder(folder: Path) -> None:
    """Every entry under `folder` a plain file or folder: a link could lead a read out of the checkpoint."""
    for root, dirs, files in os.walk(folder):
        for entry in dirs + files:
            path = Path(root) / entry
            mode = os.lstat(path).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a plain file"
                raise CheckpointError(f"{path}: {kind} inside the Orbax checkpoint {folder}; moespec reads only the "
                                      f"checkpoint's own files")


def _tensorstore() -> Any:
    try:
        import tensorstore  # optional: only Orbax folders need it
    except ImportError:
        raise CheckpointError(f"reading an Orbax checkpoint needs TensorStore, which is not installed: {INSTALL}"
                              ) from None
    return tensorstore

"""Stage 5, io: files on disk, independent of models. Atomic writes, the safetensors format, sharding.

    atomic.py       check_output ("exists; pass --force"), atomic_output (temp + fsync + rename)
    outputs.py      a checkpoint output's checks (its name, "exists; pass --force", --max-shard-size), torch-free
    lock.py         output_lock: one writer per output at a time, a lock file next to it naming its owner
    safetensors.py  headers validated by the safetensors library, reads straight into tensors, streaming writes
    sharding.py     shard layout, the files of a (sharded) checkpoint, sizes like "2GB"
    write_ids.py    which write made each shard: a reader never mixes two writes
    writer.py       write_sharded: all files or none, as a reader sees it, even when killed
"""

from typing import TYPE_CHECKING

from ..lazy import lazy_names

# The torch-free modules are imported here; the others lazily (PEP 562, as the package's own `__init__`): reading
# a safetensors file imports torch, seconds that the torch-free checks ("already exists; pass --force",
# `validate --fix`'s rewrite) should not pay. Each of their names is imported from its module on first use.
from .atomic import atomic_output, check_output, commit, default_mode, remove_stale_temp_files, temp_output
from .lock import output_lock
from .outputs import check_checkpoint_output, parse_size

if TYPE_CHECKING:
    from .safetensors import (
        DTYPE_NAMES,
        READ_DTYPES,
        SAFETENSORS_DTYPES,
        CheckpointChanged,
        SafetensorsFile,
        TensorInfo,
        check_castable,
        open_safetensors,
        read_safetensors_header,
        read_safetensors_into,
        safetensors_shapes,
        write_safetensors,
    )
    from .sharding import (
        DEFAULT_MAX_SHARD_SIZE,
        Checkpoint,
        checkpoint_files,
        index_file,
        open_checkpoint,
        shard_files,
        shard_layout,
    )
    from .write_ids import WRITE_ID_KEY, check_write_ids
    from .writer import refuse_existing, write_sharded

_LAZY = {
    "Checkpoint": "sharding", "CheckpointChanged": "safetensors", "DEFAULT_MAX_SHARD_SIZE": "sharding",
    "DTYPE_NAMES": "safetensors", "READ_DTYPES": "safetensors", "SAFETENSORS_DTYPES": "safetensors",
    "SafetensorsFile": "safetensors", "TensorInfo": "safetensors", "WRITE_ID_KEY": "write_ids",
    "check_castable": "safetensors", "check_write_ids": "write_ids", "checkpoint_files": "sharding",
    "index_file": "sharding", "open_checkpoint": "sharding", "open_safetensors": "safetensors",
    "read_safetensors_header": "safetensors", "read_safetensors_into": "safetensors", "refuse_existing": "writer",
    "safetensors_shapes": "safetensors", "shard_files": "sharding", "shard_layout": "sharding",
    "write_safetensors": "safetensors", "write_sharded": "writer",
}
"""Public name -> the module of this package that defines it."""

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "DTYPE_NAMES", "READ_DTYPES", "SAFETENSORS_DTYPES", "Checkpoint",
           "CheckpointChanged", "SafetensorsFile", "TensorInfo", "WRITE_ID_KEY", "atomic_output", "check_castable",
           "check_checkpoint_output", "check_output", "check_write_ids", "checkpoint_files", "commit", "default_mode",
           "index_file", "open_checkpoint", "open_safetensors", "output_lock", "parse_size", "read_safetensors_header",
           "read_safetensors_into", "refuse_existing", "remove_stale_temp_files", "safetensors_shapes", "shard_files",
           "shard_layout", "temp_output", "write_safetensors", "write_sharded"]


__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY, __all__)

"""Stage 5, io: files on disk, independent of models. Atomic writes, the safetensors format, sharding.

    atomic.py       check_output ("exists; pass --force"), atomic_output (temp + fsync + rename)
    safetensors.py  headers validated by the safetensors library, reads straight into tensors, streaming writes
    sharding.py     shard layout, write_sharded, the files of a (sharded) checkpoint, sizes like "2GB"
"""

from .atomic import atomic_output, check_output, default_mode, remove_stale_temp_files
from .safetensors import (
                          DTYPE_NAMES,
                          READ_DTYPES,
                          SAFETENSORS_DTYPES,
                          TensorInfo,
                          check_castable,
                          read_safetensors_header,
                          read_safetensors_into,
                          safetensors_shapes,
                          write_safetensors,
)
from .sharding import (
                          DEFAULT_MAX_SHARD_SIZE,
                          checkpoint_files,
                          index_file,
                          parse_size,
                          refuse_existing,
                          shard_files,
                          shard_layout,
                          write_sharded,
)

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "DTYPE_NAMES", "READ_DTYPES", "SAFETENSORS_DTYPES", "TensorInfo", "atomic_output",
           "check_castable", "check_output", "checkpoint_files", "default_mode", "index_file", "parse_size",
           "read_safetensors_header", "read_safetensors_into", "refuse_existing", "remove_stale_temp_files",
           "safetensors_shapes", "shard_files", "shard_layout", "write_safetensors", "write_sharded"]

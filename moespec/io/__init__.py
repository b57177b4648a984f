"""Stage 5, io: files on disk, independent of models. Atomic writes, the safetensors format, sharding.

    atomic.py       check_output ("exists; pass --force"), atomic_output (temp + fsync + rename)
    lock.py         output_lock: one writer per output at a time, a lock file next to it naming its owner
    safetensors.py  headers validated by the safetensors library, reads straight into tensors, streaming writes
    sharding.py     shard layout, the files of a (sharded) checkpoint, sizes like "2GB"
    write_ids.py    which write made each shard: a reader never mixes two writes
    writer.py       write_sharded: all files or none, as a reader sees it, even when killed
"""

from .atomic import atomic_output, check_output, commit, default_mode, remove_stale_temp_files, temp_output
from .lock import output_lock
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
                          parse_size,
                          shard_files,
                          shard_layout,
)
from .write_ids import WRITE_ID_KEY, check_write_ids
from .writer import check_checkpoint_output, refuse_existing, write_sharded

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "DTYPE_NAMES", "READ_DTYPES", "SAFETENSORS_DTYPES", "Checkpoint",
           "CheckpointChanged", "SafetensorsFile", "TensorInfo", "WRITE_ID_KEY", "atomic_output", "check_castable",
           "check_checkpoint_output", "check_output", "check_write_ids", "checkpoint_files", "commit", "default_mode",
           "index_file", "open_checkpoint", "open_safetensors", "output_lock", "parse_size", "read_safetensors_header",
           "read_safetensors_into", "refuse_existing", "remove_stale_temp_files", "safetensors_shapes", "shard_files",
           "shard_layout", "temp_output", "write_safetensors", "write_sharded"]

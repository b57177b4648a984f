"""Named choices and limits that the stages take and the CLI's options list in `--help`.

They live here, free of torch, so that the CLI can declare its options without importing the stages that use
them (`moespec --help` would pay seconds for torch and timm); those stages import them from here, the one
source.
"""

from .errors import MoespecError

PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""The precisions a checkpoint may be written in: the names the CLI takes (`--dtype bf16`) -> the torch dtype's
name. `io.DTYPE_NAMES` maps them to the torch dtypes."""

STATS_FORMATS = ("table", "markdown", "csv", "json")
"""What `counting.render` writes stats records as (`--format`)."""

DISPATCH_FLOPS = ("gather", "einsum")
"""How `stats` costs an MoE layer's dispatch and combine (`--dispatch-flops`): `gather`, as moespec runs it (the
items indexed to their experts, one MAC per output channel of each weighted row in the combine); `einsum`, as
JAX implementations run it (one-hot einsums over each routing group, every capacity slot through its expert)."""

ATTENTION_MATMULS = ("count", "skip")
"""Whether `stats` counts attention's QK^T and AV products (`--attention-matmuls`): `count` (fvcore with
moespec's handle for them, the default) or `skip` (as fvcore alone counts a ViT, and the seeds' ViT-S figures)."""

MAX_POINTS = 256
"""Grid points a sweep counts unless told more (`--max-points`): ten values in each of five `--set`s are 100,000
points, hours of counting, better asked for on purpose."""

MAX_SEED = 2**63 - 1
"""The largest seed torch takes for every generator it seeds (up to `seed + 1`)."""


def check_seed(seed: int, name: str = "seed") -> int:
    """`seed` when torch takes it for every generator it seeds (up to `seed + 1`), else a `MoespecError`."""
    if not 0 <= seed <= MAX_SEED:
        raise MoespecError(f"{name} {seed}: expected a whole number from 0 to 2**63 - 1 ({MAX_SEED})")
    return seed

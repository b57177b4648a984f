"""Options that several commands share, defined once: the output options of the commands that write a model
checkpoint (`compile`, `upcycle`, `prune`, `merge`, `densify`), and `--ranks` (`plan`, `stats`)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from ..choices import ATTENTION_MATMULS, DISPATCH_FLOPS, PRECISIONS, STATS_FORMATS

OutputFile = Annotated[Path, typer.Option(
    "-o", "--output", help="Output .safetensors file; beyond --max-shard-size, shards and an index next to it.")]
MaxShardSize = Annotated[str, typer.Option(
    "--max-shard-size", help="Largest file to write, e.g. 2GB, 500MB, 1GiB.")]
Overwrite = Annotated[bool, typer.Option("--force", help="Overwrite an existing output.")]
RANKS_HELP = ("Per-rank figures under expert parallelism over N ranks: each MoE layer's experts split evenly, the "
              "rest replicated; params and fp32 AdamW training memory per rank (activations not included).")
HubFolder = Annotated[bool, typer.Option("--hub", help="Write -o as a Hugging Face Hub folder (config.json, "
                                         "model.safetensors, README.md model card) that timm.create_model("
                                         "'local-dir:...') and 'hf-hub:...' build; see docs/sharing.md.")]

DType = Enum("DType", {name: name for name in PRECISIONS}, type=str)
"""`--dtype` choices: the names of `choices.PRECISIONS` (`io.DTYPE_NAMES` maps them to torch dtypes)."""
Format = Enum("Format", {name: name for name in STATS_FORMATS}, type=str)
"""`--format` choices: the renderers of `counting.render`, `choices.STATS_FORMATS`."""
Dispatch = Enum("DispatchFlops", {name: name for name in DISPATCH_FLOPS}, type=str)
"""`stats --dispatch-flops` choices (`choices.DISPATCH_FLOPS`)."""
Attention = Enum("AttentionMatmuls", {name: name for name in ATTENTION_MATMULS}, type=str)
"""`stats --attention-matmuls` choices (`choices.ATTENTION_MATMULS`)."""

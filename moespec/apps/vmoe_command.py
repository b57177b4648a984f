"""The command `moespec import-vmoe PATH -o OUT.safetensors`: a released V-MoE checkpoint as a moespec checkpoint
(`weights.vmoe.import_vmoe`, then `weights.save`), which `moespec.load` rebuilds. Registered on the CLI's app by
`register`; torch is imported inside the command body (`moespec --help` does not pay for it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from ..io import check_checkpoint_output, parse_size
from .options import MaxShardSize, OutputFile, Overwrite


def register(app: typer.Typer, run: Callable[[Callable[[], None]], None], out) -> None:
    """Add `import-vmoe` to `app`; `run` turns user mistakes into one line and exit 2 (`cli._run`)."""

    @app.command("import-vmoe")
    def import_vmoe_command(
        path: Annotated[Path, typer.Argument(help="A vmoe checkpoint prefix (PREFIX.index + PREFIX.data-*) or an "
                                             "Orbax checkpoint folder.")],
        output: OutputFile,
        top_k: Annotated[int, typer.Option("--top-k", min=1, help="Experts per token (V-MoE: 2).")] = 2,
        capacity_factor: Annotated[Optional[float], typer.Option(
            "--capacity-factor", help="Capacity factor C (V-MoE: 1.05 in training; its configs evaluate at 4.0 or "
            "1.05).")] = 1.05,
        group_size: Annotated[Optional[int], typer.Option(
            "--group-size", min=1, help="Tokens per routing group, as vmoe counts them (a multiple of an image's "
            "tokens); default: 8 images, as V-MoE's configs.")] = None,
        batch_priority: Annotated[bool, typer.Option("--batch-priority", help="Batch prioritized routing "
                                                     "(vmoe's batch_priority).")] = False,
        max_shard_size: MaxShardSize = "2GB",
        force: Overwrite = False,
    ) -> None:
        """Import a Google V-MoE checkpoint (legacy .index/.data or Orbax) as a moespec checkpoint."""

        def body() -> None:
            limit = parse_size(max_shard_size, "--max-shard-size")  # the output's checks first: they need no torch
            check_checkpoint_output(output, force)
            from ..compiler import moe_layers
            from ..weights import save
            from ..weights.vmoe import architecture, import_vmoe, open_vmoe

            reader = open_vmoe(path)
            arch = architecture(reader.shapes(), reader.index)
            tokens = group_size if group_size is not None else 8 * arch.tokens
            model = import_vmoe(path, top_k=top_k, capacity_factor=capacity_factor, group_size=tokens,
                                batch_priority=batch_priority)
            save(model, output, force=force, max_shard_size=limit)
            out.print(f"wrote {output}: V-MoE {arch.image} px, patch {arch.patch[0]}, width {arch.width}, depth "
                      f"{arch.depth}, {len(moe_layers(model))} MoE layers (blocks {list(arch.moe_blocks)}) of "
                      f"{arch.experts} experts, top-{top_k}, groups of {tokens} tokens", markup=False)

        run(body)

"""The commands `moespec prune | merge | densify`: load a checkpoint (or a spec), call `moespec.compress`, print
what it cost, write the new checkpoint atomically (`weights.save`). Registered on the CLI's app by `register`;
torch is imported inside the command bodies (`moespec --help` does not pay for it)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from ..errors import MoespecError
from ..io import check_checkpoint_output, parse_size
from ..spec import load_spec
from ..spec.loading import SPEC_SUFFIXES
from .options import MaxShardSize, OutputFile, Overwrite

Source = Annotated[Path, typer.Argument(
    help="A moespec checkpoint (.safetensors, sharded index or folder), or a spec (built with a random init).")]
Images = Annotated[Path, typer.Option(
    "--images", metavar="DIR", help="Calibration images: every image file under DIR (subfolders too).")]
CompareOn = Annotated[Optional[Path], typer.Option(
    "--compare-images", metavar="DIR", help="Measure the cost on these images instead of the calibration ones.")]
SpecOption = Annotated[Optional[Path], typer.Option(
    "--spec", help="The spec of a checkpoint without one inside (a timm training checkpoint, .pth.tar).")]
Score = Enum("Score", {"reap": "reap", "load": "load"}, type=str)
By = Enum("By", {"output": "output", "router": "router"}, type=str)
How = Enum("How", {"average": "average", "top": "top"}, type=str)
Keep = Annotated[str, typer.Option("--keep", metavar="N", help="Experts to keep in each MoE layer, or a fraction of "
                                   "them (0.5).")]
ScoreOption = Annotated[Score, typer.Option("--score", help="reap: router-weighted output norm (REAP); load: routed "
                                            "items.")]
Into = Annotated[str, typer.Option("--into", metavar="N", help="Experts of each MoE layer after merging, or a "
                                   "fraction of them (0.5).")]
ByOption = Annotated[By, typer.Option("--by", help="Group experts by their outputs on the images or by their router "
                                      "rows.")]
Fit = Annotated[bool, typer.Option("--fit/--no-fit", help="Fit the merged router on the images.")]


def parse_count(text: str, option: str) -> int | float:
    """`--keep 4` (experts per layer) or `--keep 0.5` (a fraction of each layer's experts)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise MoespecError(f"{option} {text!r}: give a number of experts (4) or a fraction of them (0.5)") from None
    if not 0 < value < 1:
        raise MoespecError(f"{option} {text!r}: a fraction of the experts is between 0 and 1")
    return value


def load_source(source: Path, spec: Path | None):
    """The model of a checkpoint (or a spec's, randomly initialized), in eval mode."""
    from ..compiler import create_model
    from ..weights import load

    if not source.exists():
        raise MoespecError(f"{source}: no such checkpoint or spec")
    if source.suffix in SPEC_SUFFIXES and spec is None:
        return create_model(load_spec(source), seed=0).eval()
    return load(source, spec=spec).eval()


def _compress(operation: str, source: Path, spec: Path | None, images: Path | None, output: Path, force: bool,
              max_shard_size: str, out, count: Callable[[], int | float] | None, **options) -> None:
    """One command: check the options and the output, load, call `compress.<operation>_with_report`, print the
    report, write the checkpoint (`weights.save`: atomic, sharded beyond `max_shard_size`)."""
    from ..compress import densify_with_report, merge_with_report, prune_with_report
    from ..io.sharding import checkpoint_files
    from ..weights import save

    counts = () if count is None else (count(),)
    limit = parse_size(max_shard_size, "--max-shard-size")
    check_checkpoint_output(output, force)
    run = {"prune": prune_with_report, "merge": merge_with_report, "densify": densify_with_report}[operation]
    model, report = run(load_source(source, spec), images, *counts, **options)
    out.print(str(report), markup=False, soft_wrap=True)
    save(model, output, force=force, max_shard_size=limit)
    files = checkpoint_files(output)[1]
    out.print(f"wrote {output}" + (f" ({len(files)} shards and an index)" if len(files) > 1 else ""), markup=False)


def register(app: typer.Typer, run: Callable[[Callable[[], None]], None], out) -> None:
    """Add the three commands to `app`; `run` turns user mistakes into one line and exit 2 (`cli._run`)."""

    @app.command("prune")
    def prune_command(source: Source, images: Images, output: OutputFile,
                      keep: Keep, score: ScoreOption = Score.reap,
                      compare_images: CompareOn = None, spec: SpecOption = None,
                      max_shard_size: MaxShardSize = "2GB", force: Overwrite = False) -> None:
        """Keep the best N experts of each MoE layer, scored on calibration images (unused experts go first)."""

        run(lambda: _compress("prune", source, spec, images, output, force, max_shard_size, out,
                              lambda: parse_count(keep, "--keep"), score=score.value, compare_on=compare_images))

    @app.command("merge")
    def merge_command(source: Source, images: Images, output: OutputFile,
                      into: Into, by: ByOption = By.output, fit: Fit = True,
                      compare_images: CompareOn = None, spec: SpecOption = None,
                      max_shard_size: MaxShardSize = "2GB", force: Overwrite = False) -> None:
        """Merge each MoE layer's experts into N: grouped by similarity, aligned, averaged by usage."""

        run(lambda: _compress("merge", source, spec, images, output, force, max_shard_size, out,
                              lambda: parse_count(into, "--into"), by=by.value, fit=fit, compare_on=compare_images))

    @app.command("densify")
    def densify_command(source: Source, output: OutputFile,
                        images: Annotated[Optional[Path], typer.Option(
                            "--images", metavar="DIR", help="Images to weight the experts by their use (default: "
                            "equal weights).")] = None,
                        how: Annotated[How, typer.Option("--how", help="average: usage-weighted average of the "
                                                         "aligned experts; top: the most used expert.")] = How.average,
                        compare_images: CompareOn = None, spec: SpecOption = None,
                        max_shard_size: MaxShardSize = "2GB", force: Overwrite = False) -> None:
        """Turn each MoE layer back into the dense FFN: a checkpoint the plain timm model loads (strict=True)."""

        run(lambda: _compress("densify", source, spec, images, output, force, max_shard_size, out, None,
                              how=how.value, compare_on=compare_images))

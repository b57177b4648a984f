"""The `moespec` command line: load, call one library function, render.

User mistakes (`MoespecError`) print `moespec: error: ...` and exit 2 with no traceback; anything else is
a bug in moespec and exits 1 with a hint to rerun with `--debug`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Callable, List, Optional, Tuple

import typer
from rich.console import Console

from .apps import compression, hub_files, measure, terminal, vmoe_command
from .apps.options import RANKS_HELP, Attention, Dispatch, DType, Format, HubFolder, MaxShardSize, OutputFile, Overwrite
from .choices import MAX_POINTS, check_seed
from .errors import MoespecError, SpecError
from .io import check_checkpoint_output, check_output, parse_size
from .planning import plan, plan_file
from .planning.table import plan_table
from .spec import json_schema_text, load_model_spec, load_spec, spec_files
from .spec.loading import fix_spec_file, previous_release_keys

# Each command imports the stages it needs beyond the spec and the plan inside its body: they import torch and
# timm, seconds that `moespec --help` and `moespec schema` should not pay (tests/test_cli_imports.py). The plan
# imports them only for a backbone its cache has not seen (planning/cache.py).

app = typer.Typer(
    name="moespec",
    help="Declarative Mixture-of-Experts surgery for timm vision models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(width=None if sys.stdout.isatty() else 240, highlight=False)  # tables piped to a file: never cut;
# no highlighting: rich's repr highlighter is quadratic in a long word (a spec named by 60,000 letters took 57 s)


_debug = _quiet = False


@app.callback()
def _options(debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks for errors."),
             quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars.")) -> None:
    global _debug, _quiet
    _debug, _quiet = debug, quiet


def _run(action: Callable[[], int | None]) -> None:
    """Run a command body; turn user mistakes into one clear message and exit code 2."""
    try:
        code = action()
    except MoespecError as error:
        if _debug:
            raise
        messages = [str(p) for p in error.problems] if isinstance(error, SpecError) else str(error).splitlines()
        for i, message in enumerate(messages):
            terminal.error(("moespec: error: " if i == 0 or isinstance(error, SpecError) else "  ") + message)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        terminal.error("moespec: interrupted")
        raise typer.Exit(130) from None
    except BrokenPipeError:  # stdout's reader is gone (`| head`): it has read all it wanted
        terminal.to_devnull(sys.stdout)
        raise typer.Exit(0) from None
    except Exception as error:  # a bug in moespec, not a user mistake
        if _debug:
            raise
        terminal.error(f"moespec: internal error: {type(error).__name__}: {error}")
        terminal.error("this is a bug in moespec; rerun with --debug for the traceback and report it")
        raise typer.Exit(1) from None
    if code:
        raise typer.Exit(code)


def _report_failure(file: Path, error: MoespecError) -> None:
    """The problems of one spec of several, one line each; the other specs go on."""
    named = str(error).startswith(f"{file}:")  # the error names the file already
    for problem in error.problems if isinstance(error, SpecError) else [str(error) if named else f"{file}: {error}"]:
        terminal.error(f"moespec: error: {problem}")


@app.command()
def validate(specs: List[Path] = typer.Argument(..., help="Spec files or folders of specs."),
             fix: bool = typer.Option(False, "--fix", help="Rewrite valid specs of the previous release in the new "
                                      "form (top_k and capacity_factor inside router:), comments kept.")) -> None:
    """Check specs against the schema and their timm backbones; report every problem."""

    def body() -> int:
        failed = 0
        for file in spec_files(specs):
            try:
                p = plan_file(file, cached=True)
                old_keys = previous_release_keys(file)
                where = fix_spec_file(file) if old_keys and fix else ""
            except MoespecError as error:
                failed += 1
                _report_failure(file, error)
                continue
            out.print(f"ok: {file} ({p.model}, {len(p.layers)} MoE layers)", markup=False)
            if old_keys:
                moved = ", ".join(old_keys)
                terminal.error(f"moespec: {'fixed' if fix else 'note'}: {file}{where}: {moved}: "
                       + ("moved into the router" if fix else "the previous release's form, still read; "
                          "`moespec validate --fix` moves it into the router"))
        return 2 if failed else 0

    _run(body)




@app.command("plan")
def plan_command(spec: Path = typer.Argument(..., help="Spec file, or a Hub folder of a moespec model."),
                 ranks: Optional[int] = typer.Option(None, "--ranks", min=1, metavar="N", help=RANKS_HELP)) -> None:
    """Show which FFNs become MoE layers, with their widths, experts, k and router."""

    def body() -> None:
        loaded = load_model_spec(spec)
        p = plan(loaded, cached=True)
        out.print(p.summary(), markup=False, soft_wrap=True)
        out.print(plan_table(p))
        if not p.layers:
            out.print("no MoE layers: this spec is the dense backbone")
        if ranks is not None:
            from .counting import per_rank, rank_summary, stats
            out.print(rank_summary(per_rank(stats(loaded), ranks)), markup=False, soft_wrap=True)

    _run(body)


@app.command("compile")
def compile_command(
    spec: Annotated[Path, typer.Argument(help="Spec file.")],
    output: OutputFile,
    max_shard_size: MaxShardSize = "2GB",
    force: Overwrite = False,
    seed: Annotated[int, typer.Option(help="Seed for the random initialization.")] = 0,
    hub: HubFolder = False,
) -> None:
    """Build the MoE model with random weights and save it (spec embedded)."""

    def body() -> None:
        limit = parse_size(max_shard_size, "--max-shard-size")  # the output's checks first: they need no torch
        check_seed(seed, "--seed")
        hub_files.check_hub_output(output, force) if hub else check_checkpoint_output(output, force)
        from .apps.hub_folder import save_for_hf
        from .compiler import create_model, moe_layers
        from .io.sharding import checkpoint_files, index_file
        from .weights import save

        model = create_model(load_spec(spec), seed=seed)
        if hub:
            save_for_hf(model, output, force=force)
            return out.print(f"wrote {output} (a Hub folder; {len(moe_layers(model))} MoE layers)", markup=False)
        save(model, output, force=force, max_shard_size=limit)
        _, files = checkpoint_files(output)
        layers = f"{len(moe_layers(model))} MoE layers"
        if len(files) > 1:
            out.print(f"wrote {index_file(output)} ({layers}; {len(files)} shards and an index)", markup=False)
        else:
            out.print(f"wrote {output} ({layers})", markup=False)

    _run(body)




@app.command("upcycle")
def upcycle_command(
    spec: Annotated[Path, typer.Argument(help="Spec file.")],
    output: OutputFile,
    sources: Annotated[Optional[List[Path]], typer.Argument(
        help="Dense checkpoints (.safetensors/.pth/.bin) of the spec's backbone; several: expert i takes its FFN "
             "from source upcycle.experts_from[i], by default i mod their number. Default: the spec's backbone.",
        show_default=False)] = None,
    checkpoint: Annotated[Optional[List[Path]], typer.Option(
        "--checkpoint", "-c", help="A dense checkpoint, as the SOURCES arguments (repeat for several).")] = None,
    images: Annotated[Optional[List[Path]], typer.Option(
        "--images", metavar="DIR", help="A folder of images for upcycle.router_init: hidden (once per source, in "
        "their order) or kmeans (once or more); the logit checks run on them too.")] = None,
    dtype: Annotated[DType, typer.Option("--dtype", help="Precision of the written weights.")] = DType.fp32,
    max_shard_size: MaxShardSize = "2GB",
    force: Overwrite = False,
    check: Annotated[bool, typer.Option("--check/--no-check", help="Compare the result with the dense model.")] = True,
    seed: Annotated[int, typer.Option(help="Seed for router init, expert noise and drops, and k-means.")] = 0,
    trust_pickle: Annotated[bool, typer.Option(
        "--trust-pickle", help="Unpickle a .pth/.bin checkpoint that is not plain tensors (runs its code).")] = False,
    hub: HubFolder = False,
) -> None:
    """Build the MoE model with experts copied from dense checkpoints and save it, one layer at a time."""

    def body() -> None:
        if sources and checkpoint:
            raise MoespecError("give the dense checkpoints as arguments or with --checkpoint, not both")
        given = list(sources or checkpoint or [])
        limit = parse_size(max_shard_size, "--max-shard-size")  # the output's checks first: they need no torch
        check_seed(seed, "--seed")
        hub_files.check_hub_output(output, force) if hub else check_checkpoint_output(output, force)
        from .apps.hub_folder import upcycle_to_hub
        from .io.safetensors import DTYPE_NAMES
        from .weights import upcycle_to_checkpoint

        loaded = load_spec(spec)
        with terminal.progress("reading images", _quiet) as read, \
                terminal.progress("upcycling MoE layers", _quiet) as advance:
            options = dict(checkpoint=given or None, images=images or None, seed=seed, dtype=DTYPE_NAMES[dtype.value],
                           force=force, check=check, trust_pickle=trust_pickle, on_layer=advance, on_batch=read,
                           on_skip=lambda line: terminal.error(f"moespec: warning: {line}"))
            files, report = upcycle_to_hub(loaded, output, **options) if hub else \
                upcycle_to_checkpoint(loaded, output, max_shard_size=limit, **options)
        if report is not None:
            out.print(f"dense weights: {report.source}", markup=False)
            out.print(str(report), markup=False)
            out.print("\n".join(report.start_lines()), markup=False)
        shards = f" ({len(files) - 1} shards and an index)" if not hub and len(files) > 1 else ""
        out.print(f"wrote {output if hub else files[0]}{' (a Hub folder)' if hub else shards}", markup=False)

    _run(body)




@app.command("stats")
def stats_command(
    specs: List[Path] = typer.Argument(..., help="Spec files or folders of specs."),
    format: Format = typer.Option(Format.table, "--format", "-f", help="Output format."),
    per_layer: bool = typer.Option(False, "--per-layer", help="One row per MoE layer and per dense remainder."),
    input_size: Optional[Tuple[int, int, int]] = typer.Option(None, "--input-size", metavar="C H W",
                                                              help="Override the specs' input size; fixed-size models "
                                                              "(ViT, Mixer) are built at it (timm's img_size)."),
    ranks: Optional[int] = typer.Option(None, "--ranks", min=1, metavar="N", help=RANKS_HELP),
    dispatch_flops: Dispatch = typer.Option(
        Dispatch.gather, "--dispatch-flops",
        help="How MoE dispatch and combine are costed: gather (as moespec runs them) or einsum (one-hot einsums "
             "over each routing group, every capacity slot through its expert, as JAX implementations run them; "
             "routers with a capacity only). See docs/counting.md."),
    attention_matmuls: Attention = typer.Option(
        Attention.count, "--attention-matmuls",
        help="count or skip attention's QK^T and AV products (skip: as fvcore alone counts a ViT)."),
) -> None:
    """Total and activated parameters and GMACs of each spec, with its dense backbone for comparison.

    A spec that fails is reported and the others still print; the exit code is then 2.
    """

    def body() -> int:
        from .counting import at_input_size, per_rank, render, stats
        if ranks is not None and per_layer:
            raise MoespecError("--ranks adds per-spec columns; it does not combine with --per-layer")
        records, splits, failed = [], [], 0
        files = spec_files(specs)
        with terminal.progress("counting", _quiet) as advance:
            for done, file in enumerate(files):
                advance(file.name, done, len(files))
                try:
                    loaded, notes = load_model_spec(file), []  # --input-size: checked as input_size; a rebuild is said
                    sized = loaded if input_size is None else at_input_size(loaded, input_size, on_rebuild=notes.append)
                    record = stats(sized, dispatch_flops=dispatch_flops.value,
                                   attention_matmuls=attention_matmuls.value)
                    for note in notes:
                        terminal.error(f"moespec: note: {file}: {note}")
                    splits.append(per_rank(record, ranks) if ranks is not None else None)
                    records.append(record)
                except MoespecError as error:
                    failed += 1
                    _report_failure(file, error)
            advance("", len(files), len(files))
        if records:
            sys.stdout.write(render(records, format.value, per_layer=per_layer,
                                    ranks=splits if ranks is not None else None))
        return 2 if failed else 0

    _run(body)


@app.command("sweep")
def sweep_command(
    spec: Annotated[Path, typer.Argument(help="The spec to vary.")],
    settings: Annotated[List[str], typer.Option(
        "--set", metavar="PATH=V1,V2,...",
        help="Values to try at a dotted path of the spec, e.g. moe.0.experts=4,8,16 or 'moe.0.where={every: 2},"
             "{last: 2}' (YAML values; commas inside {} [] and quotes do not split). Repeat for a grid.")],
    format: Annotated[Format, typer.Option("--format", "-f", help="Output format.")] = Format.table,
    per_layer: Annotated[bool, typer.Option(
        "--per-layer", help="One row per MoE layer and per dense remainder.")] = False,
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", help="Draw activated GMACs against total parameters (.png, .svg or .pdf), with the Pareto front."
    )] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --plot file.")] = False,
    input_size: Annotated[Optional[Tuple[int, int, int]], typer.Option(
        "--input-size", metavar="C H W",
        help="Override the spec's input size; fixed-size models (ViT, Mixer) are built at it (img_size).")] = None,
    max_points: Annotated[int, typer.Option(
        "--max-points", min=1, metavar="N", help="Count grids of up to N points (more are refused).")] = MAX_POINTS,
) -> None:
    """Stats of every combination of --set values (their cartesian product), with the swept values as columns.

    Points that do not validate are listed on stderr; the others still print, and the exit code is then 2.
    """

    def body() -> int:
        from .apps.plots import check_figure_path, require_matplotlib
        from .apps.sweep import check_grid_size, parse_setting, sweep
        from .apps.sweep import plot as draw
        from .counting import render

        parsed = [parse_setting(text) for text in settings]
        check_grid_size(parsed, max_points)
        if input_size is not None:  # checked as the spec's input_size, and a rebuild said once for every point
            from .counting import at_input_size
            at_input_size(load_spec(spec), input_size, on_rebuild=lambda note: terminal.error(
                f"moespec: note: {spec}: {note}"))
        if plot is not None:
            require_matplotlib("moespec sweep --plot")
            check_figure_path(plot, force)
        with terminal.progress("sweeping", _quiet) as advance:
            points = sweep(spec, parsed, input_size=input_size, on_point=advance, max_points=max_points)
        valid = [p for p in points if p.stats is not None]
        for point in points:
            for problem in point.problems:
                terminal.error(f"moespec: error: point {point.label}: {problem}")
        if valid:
            sys.stdout.write(render([p.stats for p in valid], format.value, per_layer=per_layer,
                                    settings=[p.settings for p in valid]))
        if plot is not None and valid:
            draw(points, plot, title=f"{valid[0].stats.name}: {len(valid)} designs")
            terminal.error(f"moespec: wrote {plot}")
        return 2 if len(valid) < len(points) else 0

    _run(body)


@app.command("inspect")
def inspect_command(
    source: Annotated[Path, typer.Argument(
        help="A spec (built with a random init) or a moespec checkpoint (.safetensors, sharded index or folder).")],
    images: Annotated[Path, typer.Option("--images", help="Labelled images: one subfolder of images per class.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Report folder (index.html, summary.json, figures).")],
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="At most N images per class.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Images per forward.")] = 32,
    seed: Annotated[int, typer.Option(help="Seed for a spec's random initialization.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing, non-empty report folder.")] = False,
    spec: Annotated[Optional[Path], typer.Option(
        "--spec", help="The spec of a checkpoint without one inside (a timm training checkpoint, .pth.tar).")] = None,
    ema: Annotated[bool, typer.Option("--ema", help="With --spec: the checkpoint's EMA weights.")] = False,
    trust_pickle: Annotated[bool, typer.Option(
        "--trust-pickle", help="Unpickle a training checkpoint's non-tensor state (can run code: trusted files only).")
    ] = False,
) -> None:
    """Route labelled images through the model and show, per MoE layer, which experts each class uses."""

    def body() -> None:
        from .apps.inspect_report import check_report_folder, write_report
        from .apps.inspection import find_images, inspect_routing, load_model
        from .apps.plots import require_matplotlib

        require_matplotlib("moespec inspect")
        check_output(output, force, folder=True)
        check_report_folder(output, [images, source, spec])
        folder = find_images(images, limit)
        model = load_model(source, seed=seed, spec=spec, ema=ema, trust_pickle=trust_pickle)
        with terminal.progress("routing images", _quiet) as advance:
            report = inspect_routing(model, folder, batch_size=batch_size, source=str(source), on_batch=advance)
        for skipped in report.skipped[:5]:
            terminal.error(f"moespec: warning: skipped an unreadable image: {skipped}")
        if len(report.skipped) > 5:
            terminal.error(f"moespec: warning: skipped {len(report.skipped) - 5} more unreadable images "
                           f"(see summary.json)")
        write_report(report, output, force=force, inputs=[images, source, spec])
        out.print(f"wrote {output / 'index.html'} ({len(report.layers)} MoE layers, {sum(report.images_per_class)} "
                  f"images in {len(report.classes)} classes)", markup=False)
        out.print(f"per image: {report.experts_per_image:.1f} experts (distinct, summed over the layers), "
                  f"{report.activated_params_per_image / 1e6:.2f}M parameters", markup=False)

    _run(body)


compression.register(app, _run, out)  # prune, merge, densify
vmoe_command.register(app, _run, out)  # import-vmoe
measure.register(app, _run, out, lambda: _quiet)  # bench, eval


@app.command("schema")
def schema_command() -> None:
    """Print the JSON Schema of spec files (what moespec/spec.schema.json holds, for editors)."""

    def body() -> None:
        sys.stdout.write(json_schema_text())

    _run(body)


def main() -> None:
    terminal.steady_streams()
    sys.exit(terminal.run_app(app))


if __name__ == "__main__":
    main()

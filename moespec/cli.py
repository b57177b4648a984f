"""The `moespec` command line: load, call one library function, render.

User mistakes (`MoespecError`) print `moespec: error: ...` and exit 2 with no traceback; anything else is
a bug in moespec and exits 1 with a hint to rerun with `--debug`.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import typer
from rich.console import Console
from rich.table import Table

from .errors import MoespecError, SpecError

app = typer.Typer(
    name="moespec",
    help="Declarative Mixture-of-Experts surgery for timm vision models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(width=None if sys.stdout.isatty() else 240)  # never truncate tables piped to a file


def _error(message: str) -> None:
    """One line on stderr, never wrapped (scripts and tests grep these)."""
    typer.echo(message, err=True)
_debug = False


@app.callback()
def _options(debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks for errors.")) -> None:
    global _debug
    _debug = debug


def _run(action: Callable[[], int | None]) -> None:
    """Run a command body; turn user mistakes into one clear message and exit code 2."""
    try:
        code = action()
    except MoespecError as error:
        if _debug:
            raise
        messages = [str(p) for p in error.problems] if isinstance(error, SpecError) else str(error).splitlines()
        for i, message in enumerate(messages):
            _error(("moespec: error: " if i == 0 or isinstance(error, SpecError) else "  ") + message)
        raise typer.Exit(2)
    except KeyboardInterrupt:
        _error("moespec: interrupted")
        raise typer.Exit(130)
    except Exception as error:  # a bug in moespec, not a user mistake
        if _debug:
            raise
        _error(f"moespec: internal error: {type(error).__name__}: {error}")
        _error("this is a bug in moespec; rerun with --debug for the traceback and report it")
        raise typer.Exit(1)
    if code:
        raise typer.Exit(code)


def _spec_files(paths: List[Path]) -> list[Path]:
    """Spec files named directly, plus every *.yaml / *.yml under named folders (sorted)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in (".yaml", ".yml"))
            if not found:
                raise MoespecError(f"{path}: no *.yaml spec files in this folder")
            files += found
        else:
            files.append(path)
    return files


@app.command()
def validate(specs: List[Path] = typer.Argument(..., help="Spec files or folders of specs.")) -> None:
    """Check specs against the schema and their timm backbones; report every problem."""

    def body() -> int:
        from . import load_spec, plan

        failed = 0
        for file in _spec_files(specs):
            try:
                p = plan(load_spec(file))
            except MoespecError as error:
                failed += 1
                problems = error.problems if isinstance(error, SpecError) else [f"{file}: {error}"]
                for problem in problems:
                    _error(f"moespec: error: {problem}")
                continue
            out.print(f"ok: {file} ({p.spec.backbone.model}, {len(p.layers)} MoE layers)", markup=False)
        return 2 if failed else 0

    _run(body)


@app.command("plan")
def plan_command(spec: Path = typer.Argument(..., help="Spec file.")) -> None:
    """Show which FFNs become MoE layers, with their widths, experts, k and router."""

    def body() -> None:
        from . import load_spec, plan

        p = plan(load_spec(spec))
        out.print(p.summary(), markup=False, soft_wrap=True)
        table = Table()
        for i, column in enumerate(p.COLUMNS):
            table.add_column(column, justify="right" if 2 <= i <= 7 else "left")
        for row in p.rows():
            table.add_row(*row)
        out.print(table)
        if not p.layers:
            out.print("no MoE layers: this spec is the dense backbone")

    _run(body)


@app.command("compile")
def compile_command(
    spec: Path = typer.Argument(..., help="Spec file."),
    output: Path = typer.Option(..., "-o", "--output", help="Output .safetensors file."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing output."),
    seed: int = typer.Option(0, help="Seed for the random initialization."),
) -> None:
    """Build the MoE model with random weights and save it (spec embedded)."""

    def body() -> None:
        import torch

        from . import create_model, load_spec, save

        _check_output(output, force)
        torch.manual_seed(seed)
        model = create_model(load_spec(spec))
        save(model, output, force=force)
        out.print(f"wrote {output} ({len(model.moespec_plan.layers)} MoE layers)", markup=False)

    _run(body)


@app.command("upcycle")
def upcycle_command(
    spec: Path = typer.Argument(..., help="Spec file."),
    output: Path = typer.Option(..., "-o", "--output", help="Output .safetensors file."),
    checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", "-c",
                                              help="Dense checkpoint (.safetensors/.pth/.bin); default: the spec's backbone."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing output."),
    check: bool = typer.Option(True, "--check/--no-check", help="Compare logits with the dense model."),
    seed: int = typer.Option(0, help="Seed for router init and expert noise."),
) -> None:
    """Build the MoE model with experts copied from a dense checkpoint, and save it."""

    def body() -> None:
        from . import load_spec, save
        from .upcycle import upcycle_with_report

        _check_output(output, force)
        model, report = upcycle_with_report(load_spec(spec), checkpoint, seed=seed, check=check)
        save(model, output, force=force)
        plan = model.moespec_plan
        out.print(f"upcycled {len(plan.layers)} MoE layers of {plan.spec.backbone.model}", markup=False)
        if report is not None:
            out.print(f"dense weights: {report.source}", markup=False)
            out.print(str(report), markup=False)
        out.print(f"wrote {output}", markup=False)

    _run(body)


class Format(str, Enum):
    table = "table"
    markdown = "markdown"
    csv = "csv"
    json = "json"


@app.command("stats")
def stats_command(
    specs: List[Path] = typer.Argument(..., help="Spec files or folders of specs."),
    format: Format = typer.Option(Format.table, "--format", "-f", help="Output format."),
    per_layer: bool = typer.Option(False, "--per-layer", help="One row per MoE layer and per dense remainder."),
    input_size: Optional[Tuple[int, int, int]] = typer.Option(None, "--input-size", metavar="C H W",
                                                              help="Override the specs' input size."),
) -> None:
    """Total and activated parameters and GMACs of each spec, with its dense backbone for comparison.

    A spec that fails is reported and the others still print; the exit code is then 2.
    """

    def body() -> int:
        from . import load_spec
        from .report import render
        from .stats import stats

        records, failed = [], 0
        for file in _spec_files(specs):
            try:
                records.append(stats(load_spec(file), input_size=input_size))
            except MoespecError as error:
                failed += 1
                for problem in (error.problems if isinstance(error, SpecError) else [f"{file}: {error}"]):
                    _error(f"moespec: error: {problem}")
        if records:
            sys.stdout.write(render(records, format.value, per_layer=per_layer))
        return 2 if failed else 0

    _run(body)


def _check_output(output: Path, force: bool) -> None:
    """Fail before any work if the output cannot be written."""
    if output.exists() and not force:
        raise MoespecError(f"{output} already exists; pass --force to overwrite it")
    if not output.parent.is_dir():
        raise MoespecError(f"{output.parent}: no such folder for the output")


def main() -> None:
    app()


if __name__ == "__main__":
    main()

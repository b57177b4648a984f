"""The `moespec` command line: load, call one library function, render.

User mistakes (`MoespecError`) print `moespec: error: ...` and exit 2 with no traceback; anything else is
a bug in moespec and exits 1 with a hint to rerun with `--debug`.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from enum import Enum
from pathlib import Path
from typing import Callable, List, Optional

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
) -> None:
    """Total and activated parameters of each spec, with the dense backbone for comparison."""

    def body() -> None:
        from . import load_spec
        from .stats import stats

        records = [stats(load_spec(file)) for file in _spec_files(specs)]
        render_stats(records, format)

    _run(body)


STATS_COLUMNS = ("name", "backbone", "MoE layers", "experts", "params (M)", "activated (M)", "dense params (M)")


def _stats_row(s) -> tuple[str, ...]:
    return (s.name, s.backbone, str(s.moe_layers), str(s.experts_total), f"{s.total_params / 1e6:.2f}",
            f"{s.activated_params / 1e6:.2f}", f"{s.dense_params / 1e6:.2f}")


def render_stats(records: list, format: Format) -> None:
    footer = ("params: total parameters; activated: parameters used per token (everything outside MoE layers + "
              "routers + shared experts + top_k routed experts); M = 10^6, exact counts in --format json.")
    rows = [_stats_row(s) for s in records]
    if format is Format.json:
        sys.stdout.write(json.dumps([s.to_dict() for s in records], indent=2) + "\n")
    elif format is Format.csv:
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(STATS_COLUMNS)
        writer.writerows(rows)
        sys.stdout.write(buffer.getvalue())
    elif format is Format.markdown:
        lines = ["| " + " | ".join(STATS_COLUMNS) + " |", "|" + "|".join("---" for _ in STATS_COLUMNS) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        sys.stdout.write("\n".join(lines) + f"\n\n{footer}\n")
    else:
        table = Table(caption=footer, caption_justify="left")
        for i, column in enumerate(STATS_COLUMNS):
            table.add_column(column, justify="left" if i < 2 else "right", no_wrap=i < 2)
        for row in rows:
            table.add_row(*row)
        out.print(table)


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

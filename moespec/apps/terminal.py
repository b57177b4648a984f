"""The command line's terminal: one-line errors on stderr, standard streams that never fail the command (closed
at start, a reader gone, an encoding that cannot show a character), and progress on stderr."""

from __future__ import annotations

import contextlib
import os
import sys

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def error(message: str) -> None:
    """One line on stderr, never wrapped (scripts and tests grep these). Where no one reads stderr any more (its
    reader is gone), the line is dropped and the command goes on."""
    try:
        typer.echo(message, err=True)
    except BrokenPipeError:
        to_devnull(sys.stderr)


def to_devnull(stream) -> None:
    """Point the stream's file descriptor at /dev/null: its reader is gone, and what is still buffered (or
    written later, by us or a library) must not fail again, at exit least of all."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def steady_streams() -> None:
    """Before anything runs: a standard stream that was closed (`2>&-`) is opened on /dev/null, so that no file
    moespec opens takes its number (a library's warning would then be written into it), and stdout and stderr
    replace what their encoding cannot show (a Latin-1 locale and a table's rules) instead of failing."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != fd:
                os.dup2(opened, fd)
                os.close(opened)
    for name, fd in (("stdout", 1), ("stderr", 2)):
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "w", closefd=False))
        with contextlib.suppress(AttributeError, ValueError):
            getattr(sys, name).reconfigure(errors="replace")


@contextlib.contextmanager
def progress(description: str, quiet: bool = False):
    """Progress on stderr while the block runs, fed by the `update(item, done, total)` it yields: a rich bar
    on a terminal; where stderr is not one (piped, redirected to a log), one plain line per item of a run of
    several as the item starts, numbered from 1 (`moespec: counting: 2/31 b.yaml`: the second of 31, while
    `done` is 1), so that a long run piped to a file is not silent (a run of one item says nothing: its error,
    if any, stays the first line). None with `quiet` (`--quiet`)."""
    if quiet:
        yield lambda item, done, total: None
        return
    if not sys.stderr.isatty():
        yield lambda item, done, total: item and total > 1 and error(
            f"moespec: {description}: {done + 1}/{total} {item}")
        return
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[item]}"), TimeElapsedColumn(),
                   console=Console(stderr=True, highlight=False), transient=True)
    task = bar.add_task(description, total=None, item="")
    with bar:
        yield lambda item, done, total: bar.update(task, completed=done, total=total, item=item)


def run_app(app: typer.Typer, args: list[str] | None = None) -> int:
    """Run the typer app and return its exit code; a usage mistake (a missing option argument, an unknown
    option, a bad choice) is one line, `moespec: error: stats: option '--format' requires an argument; see
    `moespec stats --help``, exit 2, in place of click's usage lines and typer's box. (typer vendors click:
    its exceptions are reached through the public `typer.TyperException`, their base.)"""
    command = typer.main.get_command(app)
    args = sys.argv[1:] if args is None else list(args)
    try:
        code = command.main(args=args, prog_name="moespec", standalone_mode=False)
    except typer.TyperException as mistake:
        if type(mistake).__name__ == "NoArgsIsHelpError":  # `moespec` alone: the help is printed already
            return 2
        message = " ".join(mistake.format_message().split()).rstrip(".")
        # the command it was given to; a missing option argument is raised with no context (or the group's)
        names = getattr(command, "commands", {})
        where = next((arg for arg in args if arg in names), "")
        path = f"moespec {where}".strip()
        error(f"moespec: error: {where + ': ' if where else ''}{message[:1].lower()}{message[1:]}; "
              f"see `{path} --help`")
        return getattr(mistake, "exit_code", 2)
    except typer.Abort:  # end of input at a prompt
        error("moespec: interrupted")
        return 130
    return code if isinstance(code, int) else 0

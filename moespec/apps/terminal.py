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
                   TextColumn("{task.fields[item]}"), TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    task = bar.add_task(description, total=None, item="")
    with bar:
        yield lambda item, done, total: bar.update(task, completed=done, total=total, item=item)

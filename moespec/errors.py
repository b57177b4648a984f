"""User-facing errors.

Every mistake a user can make (a bad spec, a selector that matches nothing, a checkpoint for the wrong
model) is a `MoespecError`. The CLI prints it as `moespec: error: ...` and exits 2 without a traceback;
anything else is a bug in moespec.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec, located as precisely as we can."""

    message: str
    path: str = ""  # dotted field path, e.g. "moe.0.top_k"
    file: str | None = None
    line: int | None = None  # 1-based
    column: int | None = None  # 1-based

    def __str__(self) -> str:
        where = ""
        if self.file:
            where = self.file
            if self.line is not None:
                where += f":{self.line}"
                if self.column is not None:
                    where += f":{self.column}"
            where += ": "
        field = f"{self.path}: " if self.path else ""
        return f"{where}{field}{self.message}"


class MoespecError(Exception):
    """A user mistake: reported as one clear message, never as a traceback."""


class SpecError(MoespecError, ValueError):
    """A spec that cannot be loaded, validated or applied to its backbone. Holds every problem found."""

    def __init__(self, problems: Problem | str | Sequence[Problem]):
        if isinstance(problems, (Problem, str)):
            problems = [problems]
        self.problems: list[Problem] = [p if isinstance(p, Problem) else Problem(p) for p in problems]
        super().__init__("\n".join(str(p) for p in self.problems))


class CheckpointError(MoespecError):
    """A checkpoint that cannot be read, or does not fit the model it is loaded into."""


class NotScriptableError(MoespecError, RuntimeError):
    """`torch.jit.script` of a model with MoE layers, which TorchScript cannot compile (`MoELayer`)."""


def field_path(parts: Iterable[object]) -> str:
    """A dotted field path, `moe.0.top_k`; a key that is not a plain word is quoted (`moe.0.'a\\nb'`), so a
    problem stays one line."""
    return ".".join(str(p) if re.fullmatch(r"[\w-]+", str(p), re.ASCII) else repr(str(p)) for p in parts)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`"; did you mean 'x'?"` for the closest choice, or "" when nothing is close."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""

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

    def __init__(self, problems: Problem | str | Sequence[Problem], *, timm_error: BaseException | None = None):
        if isinstance(problems, (Problem, str)):
            problems = [problems]
        self.problems: list[Problem] = [p if isinstance(p, Problem) else Problem(p) for p in problems]
        self.timm_error = timm_error
        """The exception timm raised when it refused the backbone (an unknown kwarg, a value its checks reject, a
        failed download), else None: what `timm.create_model` of a moespec name raises again (`raised_as_timm`)."""
        super().__init__("\n".join(str(p) for p in self.problems))


def raised_as_timm(error: SpecError) -> SpecError:
    """`error`, when timm refused the backbone under it, as an instance of timm's exception type too (a
    `TypeError` for an unknown kwarg, an `AssertionError` for a pool timm cannot do) with moespec's located
    message, so that a caller of `timm.create_model` catches what timm's own models raise; else `error` itself.
    A type whose constructor takes more than a message gives way to its nearest base that takes one."""
    if error.timm_error is None:
        return error
    for base in type(error.timm_error).__mro__:
        if issubclass(SpecError, base):  # Exception, BaseException: nothing more to say than SpecError does
            break
        try:
            return _with_timm_type(base)(error.problems, timm_error=error.timm_error)
        except TypeError:  # no subclass (a layout conflict, a final class) or no one-message constructor
            continue
    return error


_TIMM_TYPED: dict[type, type] = {}
"""timm's exception type -> the subclass of it and of SpecError that `raised_as_timm` makes, made once each."""


def _with_timm_type(base: type) -> type:
    if base not in _TIMM_TYPED:
        _TIMM_TYPED[base] = type(base.__name__, (SpecError, base), {
            "__module__": __name__, "__qualname__": f"SpecError.{base.__name__}",
            "__reduce__": lambda self: (_rebuilt, (base, self.problems, self.timm_error)),
            "__doc__": f"A SpecError that is also timm's {base.__name__}: see `raised_as_timm`."})
    return _TIMM_TYPED[base]


def _rebuilt(base: type, problems: list[Problem], timm_error: BaseException | None) -> SpecError:
    """The error `raised_as_timm` made, back from a pickle (another process's)."""
    return _with_timm_type(base)(problems, timm_error=timm_error)


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

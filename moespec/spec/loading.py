"""From YAML files to validated `Spec`s: `load_spec` with `file:line:col` errors, the spec files of a folder,
and locating later problems (found against the real model) in the spec's file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from pydantic import ValidationError

from ..errors import MoespecError, Problem, SpecError
from .models import Spec
from .problems import merge_alternatives, problem, yaml_kind
from .yaml_positions import Positions, load_yaml

SPEC_SUFFIXES = (".yaml", ".yml")


def read_document(path: str | Path) -> tuple[dict, Positions]:
    """A spec file as a plain YAML mapping with the position of every value, named after the file when it
    has no name. Not validated: `sweep` edits the document first."""
    file, path = str(path), Path(path)
    if not path.is_file():
        raise SpecError(Problem(f"no such spec file{'' if not path.is_dir() else ' (it is a folder)'}", file=file))
    data, positions = load_yaml(path.read_text(encoding="utf-8"), file)
    return _named(data, file), positions


def load_spec(source: str | Path | dict, *, text: str | None = None) -> Spec:
    """Load and validate a spec from a YAML file (or a dict, or YAML `text` with `source` as its name).

    Every problem is reported at once, as `file:line:col: field.path: message`, in a `SpecError`.
    """
    if isinstance(source, dict):
        return _validate(source, Positions(), file=None)
    if text is None:
        data, positions = read_document(source)
    else:
        data, positions = load_yaml(text, str(source))
        data = _named(data, str(source))
    return _validate(data, positions, file=str(source))


def _named(data: Any, file: str) -> dict:
    """The document, checked to be a mapping, with `name` defaulting to the file's stem."""
    if not isinstance(data, dict):
        found = "an empty file" if data is None else yaml_kind(data)
        raise SpecError(Problem(f"a spec is a YAML mapping with at least 'backbone', but this is {found}",
                                file=file, line=1, column=1))
    if data.get("name") is None:
        data["name"] = Path(file).stem
    return data


def _validate(data: dict, positions: Positions, file: str | None) -> Spec:
    try:
        spec = Spec.model_validate(data)
    except ValidationError as err:
        raise SpecError(merge_alternatives([problem(e, data, positions, file) for e in err.errors()])) from None
    spec._source = file
    return spec


def spec_files(paths: Sequence[str | Path]) -> list[Path]:
    """Spec files named directly, plus every *.yaml / *.yml under named folders (sorted)."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in SPEC_SUFFIXES)
            if not found:
                raise MoespecError(f"{path}: no *.yaml spec files in this folder")
            files += found
        else:
            files.append(path)
    return files


def spec_problem(spec: Spec, path: str, message: str) -> Problem:
    """A Problem about field `path` (dotted) of a validated spec, located in its file when it has one."""
    line = column = None
    if spec.source and Path(spec.source).is_file():
        try:
            _, positions = load_yaml(Path(spec.source).read_text(encoding="utf-8"), spec.source)
            line, column = positions.find(path.split("."))
        except SpecError:
            pass
    return Problem(message, path=path, file=spec.source, line=line, column=column)


def located(spec: Spec, error: SpecError) -> SpecError:
    """`error` with its unlocated problems placed in `spec`'s file (by their field path)."""
    return SpecError([spec_problem(spec, p.path, p.message) if p.file is None else p for p in error.problems])

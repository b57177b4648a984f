"""From YAML files to validated `Spec`s: `load_spec` with `file:line:col` errors, the spec files of a folder,
and locating later problems (found against the real model) in the spec's file."""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path
from typing import Any, Sequence

from pydantic import ValidationError

from ..errors import MoespecError, Problem, SpecError
from ..io.rewrite import rewrite_file
from .compat import MOVED_TO_ROUTER, CannotRewrite, upgraded_text
from .models import Spec
from .problems import hidden_cross_field_problems, merge_alternatives, problem, yaml_kind
from .yaml_limits import MAX_SPEC_BYTES
from .yaml_positions import Positions, load_yaml

SPEC_SUFFIXES = (".yaml", ".yml")
HUB_CONFIG = "config.json"
"""The file that makes a folder a Hugging Face Hub folder (timm's `save_for_hf`), whose spec `embedded.hub_spec`
reads."""


def is_hub_folder(path: str | Path) -> bool:
    """Whether `path` is a Hub folder: a folder with a config.json by that name, whatever it is (a link, a fifo:
    `embedded.hub_config` says what is wrong with it, rather than reading the folder as something else)."""
    return Path(path).is_dir() and os.path.lexists(Path(path) / HUB_CONFIG)



def read_document(path: str | Path) -> tuple[dict, Positions]:
    """A spec file as a plain YAML mapping with the position of every value, named after the file when it
    has no name. Not validated: `sweep` edits the document first."""
    file, path = str(path), Path(path)
    data, positions = load_yaml(read_spec_text(path), file)
    return _named(data, file), positions


def read_spec_text(path: Path) -> str:
    """The text of a spec file. A folder, a missing, unreadable or non-UTF-8 file, or one over `MAX_SPEC_BYTES`
    (refused before it is read) is a `SpecError` at the file (a bad byte at its line and column)."""
    file = str(path)
    try:
        if not path.is_file():  # not opened: a fifo would block, a device never end
            message = ("no such spec file (it is a folder)" if path.is_dir()
                       else "not a regular file (a fifo, socket or device); name a spec file" if path.exists()
                       else "no such spec file (a broken symbolic link)" if path.is_symlink() else "no such spec file")
            raise SpecError(Problem(message, file=file))
        with path.open("rb") as stream:
            if os.fstat(stream.fileno()).st_size > MAX_SPEC_BYTES:
                raise SpecError(Problem(f"the spec file is larger than {MAX_SPEC_BYTES:,} bytes; a spec is a few kB, "
                                        f"refusing to read it", file=file))
            data = stream.read(MAX_SPEC_BYTES + 1)  # a file that grows meanwhile is refused by `load_yaml`
    except OSError as err:
        raise SpecError(Problem(f"cannot read the spec file: {err.strerror or err}", file=file)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line_start = data.rfind(b"\n", 0, err.start) + 1
        raise SpecError(Problem(
            f"not UTF-8 text: byte 0x{data[err.start]:02x} cannot be decoded; save the spec file as UTF-8", file=file,
            line=data.count(b"\n", 0, err.start) + 1,
            column=len(data[line_start:err.start].decode("utf-8", "replace")) + 1)) from None


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
        problems = merge_alternatives([problem(e, data, positions, file) for e in err.errors()])
        raise SpecError(problems + hidden_cross_field_problems(data, problems, positions, file)) from None
    spec._source = file
    return spec


def spec_files(paths: Sequence[str | Path]) -> list[Path]:
    """Spec files named directly, plus every *.yaml / *.yml under named folders (sorted); a Hub folder (with a
    config.json) stands for its own spec (`embedded.load_model_spec`)."""
    files: list[Path] = []
    for path in map(Path, paths):
        if is_hub_folder(path):
            files.append(path)
        elif path.is_dir():
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
    positions = _file_positions(spec.source) if spec.source else None
    if positions is not None:
        line, column = positions.find(path.split("."))
    return Problem(message, path=path, file=spec.source, line=line, column=column)


def _file_positions(file: str) -> Positions | None:
    """The positions of the spec file `file` as it is now, or None when it is not a readable, valid YAML file.
    Parsed once per version of the file (a spec with many problems is located by one parse), again when it
    changes: its path, inode, size and modification time are the cache key."""
    try:
        status = os.stat(file)
    except (OSError, ValueError):  # missing, unreadable folder, or a name with a NUL
        return None
    if not stat.S_ISREG(status.st_mode):
        return None
    return _parsed_positions(file, status.st_ino, status.st_size, status.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _parsed_positions(file: str, inode: int, size: int, mtime_ns: int) -> Positions | None:
    """`_file_positions`, cached; the file's inode, size and mtime only key the cache."""
    try:
        return load_yaml(read_spec_text(Path(file)), file)[1]
    except SpecError:
        return None


def located(spec: Spec, error: SpecError) -> SpecError:
    """`error` with its unlocated problems placed in `spec`'s file (by their field path)."""
    return SpecError([spec_problem(spec, p.path, p.message) if p.file is None else p for p in error.problems],
                     timm_error=error.timm_error)


def previous_release_keys(path: str | Path, text: str | None = None) -> list[str]:
    """The release 0.1 keys a spec file (whose text is `text`, when the caller has read it) still writes on its
    surgery groups (`moe.0.top_k`, ...): what `upgraded_spec_text` moves into the routers (`spec.compat`)."""
    data = read_document(path)[0] if text is None else load_yaml(text, str(path))[0]
    groups = data.get("moe") if isinstance(data.get("moe"), list) else []
    return [f"moe.{index}.{key}" for index, group in enumerate(groups) if isinstance(group, dict)
            for key in MOVED_TO_ROUTER if key in group]


def upgraded_spec_text(path: str | Path, text: str | None = None) -> str:
    """The valid spec file `path` (whose text is `text`, when the caller has read it) in the new form, its
    comments and layout kept (`moespec validate --fix`). Checked: it loads to the same Spec as the file. What
    cannot be rewritten so is one error that names the file and the line, never a position in the rewrite."""
    file = str(path)
    text = read_spec_text(Path(path)) if text is None else text
    spec = load_spec(path, text=text)
    old_keys = ", ".join(previous_release_keys(path, text))
    try:
        new_text = upgraded_text(text)
        same = load_spec(path, text=new_text).model_dump() == spec.model_dump()
        reason = "" if same else "the rewritten file would give another spec"
    except CannotRewrite as error:
        reason = str(error)
    except SpecError as error:
        reason = f"the rewritten file would not validate: {error.problems[0].message}"
    if reason:
        raise MoespecError(f"{file}: cannot move {old_keys} into the router without losing what the file says "
                           f"({reason}); move them into `router:` by hand. Nothing was written") from None
    return new_text


def fix_spec_file(file: Path) -> str:
    """`moespec validate --fix` of one spec file: the file a symbolic link names is rewritten (the link stays; the
    returned note says which file changed), and only when it is still what was read (`io.rewrite_file`). A
    file with other names (hard links) or that is read-only is refused, left as it is."""
    target = Path(os.path.realpath(file)) if file.is_symlink() else file
    status = target.stat()
    if status.st_nlink > 1:
        raise MoespecError(f"{file}: has {status.st_nlink} names (hard links); --fix replaces the file, which would "
                           f"leave the other names with the old text. Move the keys into `router:` by hand, or "
                           f"copy it to a file of its own and fix that")
    if not status.st_mode & 0o222:
        raise MoespecError(f"{file}: read-only; --fix changes only a file you may write. Make it writable "
                           f"(chmod u+w), then run --fix again")
    text = read_spec_text(target)
    rewrite_file(target, upgraded_spec_text(file, text).encode("utf-8"), text.encode("utf-8"), status)
    return f" (the file it links to, {target})" if target != file else ""

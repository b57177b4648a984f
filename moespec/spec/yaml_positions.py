"""YAML loading that remembers where every value came from, so errors can say `file:line:col`.

PyYAML's `safe_load` forgets positions and silently keeps the last of two duplicate keys; we compose the
node tree once (within the limits of `yaml_limits`), build the data from it, and record the start mark of
every key and value.
"""

from __future__ import annotations

from typing import Any

import yaml

from ..errors import Problem, SpecError, field_path
from .yaml_limits import MAX_SPEC_BYTES, BoundedLoader, YamlLimitError


class Positions:
    """Maps a path of keys and list indices to the (line, column) of its YAML node, both 1-based."""

    def __init__(self) -> None:
        self._marks: dict[tuple[str, ...], tuple[int, int]] = {}
        self._mappings: set[tuple[str, ...]] = set()

    def add(self, path: tuple[str, ...], mark: yaml.Mark) -> None:
        """Record the first position seen for `path` (a key's position wins over its value's)."""
        self._marks.setdefault(path, (mark.line + 1, mark.column + 1))

    def add_mapping(self, path: tuple[str, ...]) -> None:
        """Record that the node at `path` is a mapping."""
        self._mappings.add(path)

    def find(self, path: list[Any]) -> tuple[int | None, int | None]:
        """The position of `path`, or of its closest ancestor that has one.

        A spec may give one mapping where a list is expected (`rescale: {where: ...}` for `rescale: [...]`),
        so its field `rescale.0.tokens` is written as `rescale.tokens`.
        """
        key: tuple[str, ...] = ()
        for part in (str(p) for p in path):
            if not (part == "0" and key in self._mappings and key + ("0",) not in self._marks):
                key += (part,)
        while key not in self._marks and key:
            key = key[:-1]
        return self._marks.get(key, (None, None))


def load_yaml(text: str, file: str) -> tuple[Any, Positions]:
    """Parse one YAML document; YAML errors, tabs, duplicate keys and documents over the limits of
    `yaml_limits` (checked before anything is constructed) become a `SpecError` with a position."""
    if len(text) > MAX_SPEC_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise SpecError(Problem(f"the spec is larger than {MAX_SPEC_BYTES:,} bytes; a spec is a few kB, refusing "
                                f"to read it", file=file))
    try:
        loader = BoundedLoader(text)
    except yaml.reader.ReaderError as err:  # the reader checks every character up front
        raise SpecError(_character_problem(err, text, file)) from None
    positions = Positions()
    try:
        node = loader.get_single_node()
        if node is not None:  # before constructing: PyYAML flattens merge keys (`<<: *base`) into the mapping
            _record(node, (), positions, loader, file)
        data = loader.construct_document(node) if node is not None else None
    except YamlLimitError as err:
        mark = err.problem_mark
        raise SpecError(Problem(err.problem, file=file, line=mark.line + 1, column=mark.column + 1)) from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        message = f"invalid YAML: {err.problem or err.context}"
        if mark is not None and "\t" in text.splitlines()[min(mark.line, len(text.splitlines()) - 1)]:
            message += "; indent with spaces, YAML does not allow tabs"
        line, column = (mark.line + 1, mark.column + 1) if mark else (None, None)
        raise SpecError(Problem(message, file=file, line=line, column=column)) from None
    except yaml.YAMLError as err:
        raise SpecError(Problem(f"invalid YAML: {' '.join(str(err).split())}", file=file)) from None
    finally:
        loader.dispose()
    return data, positions


def _character_problem(err: yaml.reader.ReaderError, text: str, file: str) -> Problem:
    """A character YAML does not allow (a control character, a lone surrogate), at its line and column."""
    line_start = text.rfind("\n", 0, err.position) + 1
    return Problem(f"invalid YAML: character #x{err.character:04x} is not allowed; remove it", file=file,
                   line=text.count("\n", 0, err.position) + 1, column=err.position - line_start + 1)


def _record(node: yaml.Node, path: tuple[str, ...], positions: Positions, loader: yaml.SafeLoader, file: str) -> None:
    positions.add(path, node.start_mark)
    if isinstance(node, yaml.MappingNode):
        positions.add_mapping(path)
        seen: dict[str, yaml.Mark] = {}
        for key_node, _ in node.value:
            key = _key(key_node, loader)
            if key is None:
                continue
            if key in seen:
                first = seen[key]
                raise SpecError(
                    Problem(
                        f"duplicate key {key!r} (first given at line {first.line + 1}); give each key once",
                        path=field_path(path + (key,)),
                        file=file,
                        line=key_node.start_mark.line + 1,
                        column=key_node.start_mark.column + 1,
                    )
                )
            seen[key] = key_node.start_mark
        for key, (key_node, value_node) in _merged_pairs(node, loader).items():
            positions.add(path + (key,), key_node.start_mark)
            _record(value_node, path + (key,), positions, loader, file)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _record(item, path + (str(index),), positions, loader, file)


MERGE_TAG = "tag:yaml.org,2002:merge"
"""The tag of a `<<` key: its value's keys are merged into the mapping, which overrides them (YAML 1.1)."""


def _key(key_node: yaml.Node, loader: yaml.SafeLoader) -> str | None:
    """A key as the spec's paths name it; None for a `<<` and for a list or mapping as a key (which the
    constructor refuses: it is not hashable)."""
    if key_node.tag == MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
        return None
    return str(loader.construct_object(key_node))


def _merged_pairs(node: yaml.MappingNode, loader: yaml.SafeLoader) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    """Key -> (key node, value node) of the mapping as PyYAML constructs it (`SafeConstructor.flatten_mapping`),
    without changing the node: the keys merged by `<<` first (of a list of mappings, the first mapping wins),
    then the mapping's own keys, each overriding what came before. A malformed `<<` is left to the constructor."""
    merged: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    own: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    for key_node, value_node in node.value:
        if key_node.tag != MERGE_TAG:
            key = _key(key_node, loader)
            if key is not None:
                own[key] = (key_node, value_node)
            continue
        sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
        for source in reversed(sources):
            if isinstance(source, yaml.MappingNode):
                merged.update(_merged_pairs(source, loader))
    return {**merged, **own}

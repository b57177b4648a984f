"""Sweeps: the stats of every point of a grid of changes to one spec.

    --set moe.0.experts=4,8,16 --set moe.0.router.top_k=1,2   ->   6 specs: experts x top_k (cartesian product)

A setting is `PATH=VALUES`. PATH walks the spec document: mapping keys and list indices, joined by dots
(`moe.0.router.kind`); a missing mapping on the way is created. VALUES are split at the commas that are not
inside brackets, braces or quotes, and each is read as a YAML value, so flow mappings and lists work:
`moe.0.where={every: 2},{last: 2}` gives two values, `moe.0.where=[{every: 2}, {last: 1}]` one (a union).
Paths are checked against the base document and the spec's keys before any work; each point is then
validated on its own, and a point that does not validate is reported with its settings, not dropped.
A grid of more than `max_points` points (default `MAX_POINTS`) is refused before any work.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from ..choices import MAX_POINTS
from ..counting import SpecStats, stats
from ..counting.report import show
from ..errors import MoespecError, SpecError, did_you_mean
from ..spec import allowed_keys, load_spec, read_document
from ..spec.compat import MOVED_TO_ROUTER
from ..spec.yaml_limits import BoundedLoader
from .plots import save_figure, sweep_figure


@dataclass(frozen=True)
class Setting:
    """One `--set PATH=VALUES`: where in the document, and the values to try there."""

    path: str  # as written, e.g. "moe.0.experts"
    values: tuple[Any, ...]

    @property
    def parts(self) -> list[str]:
        return self.path.split(".")


@dataclass(frozen=True)
class SweepPoint:
    """One point of the grid: its settings (path -> value) and its stats, or the problems that stopped it."""

    settings: dict[str, Any]
    stats: SpecStats | None = None
    problems: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """`moe.0.experts=8, moe.0.router.top_k=2`, the values in YAML flow style."""
        return ", ".join(f"{path}={show(value)}" for path, value in self.settings.items())


def split_values(text: str) -> list[str]:
    """Split at commas outside brackets, braces and quotes: `4,8` -> ['4', '8'];
    `{every: 2},{last: 2}` -> ['{every: 2}', '{last: 2}']; `[1, 2]` -> ['[1, 2]']."""
    parts, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [part.strip() for part in parts + [text[start:]]]


def parse_setting(text: str) -> Setting:
    """`PATH=V1,V2,...` -> Setting; a malformed one is a MoespecError that shows the expected form."""
    path, equals, values = text.partition("=")
    path = path.strip()
    if not equals or not path or any(not part for part in path.split(".")):
        raise MoespecError(f"--set {text!r}: expected PATH=VALUES, e.g. moe.0.experts=4,8,16")
    parsed = []
    for value in split_values(values):
        if not value:
            raise MoespecError(f"--set {text!r}: an empty value; values are separated by commas")
        try:
            parsed.append(yaml.load(value, Loader=BoundedLoader))  # noqa: S506 (a safe loader, with limits)
        except yaml.YAMLError as err:
            reason = str(err).splitlines()[0]
            raise MoespecError(f"--set {text!r}: {value!r} is not a YAML value ({reason})") from None
    return Setting(path, tuple(parsed))


def check_settings(document: dict, settings: Sequence[Setting]) -> None:
    """Each path must walk the document (list indices in range, mappings on the way) and end at a key the
    spec allows there; each path may be set once."""
    seen = set()
    for setting in settings:
        if setting.path in seen:
            raise MoespecError(f"--set {setting.path}: set twice; give all its values in one --set, comma-separated")
        seen.add(setting.path)
        assign(copy.deepcopy(document), setting, setting.values[0])


def assign(document: dict, setting: Setting, value: Any) -> None:
    """Set `value` at the setting's path of `document` (in place), creating missing mappings on the way."""
    node: Any = document
    walked: list[Any] = []
    parts = setting.parts
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.lstrip("-").isdigit() or not -len(node) <= int(part) < len(node):
                raise MoespecError(f"--set {setting.path}: {_where(walked)} is a list of {len(node)} item(s); "
                                   f"{part!r} is not an index in 0..{len(node) - 1}")
            key: Any = int(part) % len(node)
        elif isinstance(node, dict):
            key = next((k for k in node if str(k) == part), part)  # YAML keys may be ints (stages: {2: ...})
            allowed = allowed_keys(walked, node)
            if allowed and key not in node and part not in allowed:
                hint = (f"; {part} is a router setting: {_where([*walked, 'router', part])}"
                        if part in MOVED_TO_ROUTER and "router" in allowed else did_you_mean(part, allowed))
                raise MoespecError(f"--set {setting.path}: unknown key {part!r} in {_where(walked)}; allowed: "
                                   f"{', '.join(allowed)}{hint}")
        else:
            raise MoespecError(f"--set {setting.path}: {_where(walked)} is {show(node)}, not a mapping or a list")
        if last:
            node[key] = value
        else:
            if isinstance(node, dict) and node.get(key) is None:
                node[key] = {}
            node = node[key]
        walked.append(key)


def _where(walked: list[Any]) -> str:
    return ".".join(map(str, walked)) or "the spec"


def check_grid_size(settings: Sequence[Setting], max_points: int) -> int:
    """The number of points of the grid (without building it); more than `max_points` is a MoespecError that
    says how to ask for them."""
    count = math.prod(len(setting.values) for setting in settings)
    if count > max_points:
        sizes = " x ".join(str(len(setting.values)) for setting in settings)
        raise MoespecError(f"the grid has {count:,} points ({sizes} values), more than --max-points {max_points}; "
                           f"pass --max-points {count} to count them all, or give fewer values")
    return count


def grid(settings: Sequence[Setting]) -> list[dict[str, Any]]:
    """The cartesian product of the settings' values, the first setting varying slowest."""
    return [dict(zip([s.path for s in settings], values, strict=True))
            for values in itertools.product(*(s.values for s in settings))]


def sweep(spec_file: str | Path, settings: Sequence[Setting], *, input_size: tuple[int, int, int] | None = None,
          on_point: Callable[[str, int, int], None] | None = None, max_points: int = MAX_POINTS) -> list[SweepPoint]:
    """Stats of every point of the grid over `spec_file`, at most `max_points` of them (checked first).
    `on_point(label, done, total)` reports progress."""
    check_grid_size(settings, max_points)
    document = base_document(spec_file)
    check_settings(document, settings)
    points = grid(settings)
    results = []
    for done, point in enumerate(points):
        results.append(_evaluate(document, settings, point, input_size, on_point, done, len(points)))
    if on_point is not None:
        on_point("", len(points), len(points))
    return results


def base_document(spec_file: str | Path) -> dict:
    """The spec file as a plain document (YAML errors with file:line), named after the file if it has no name."""
    document, _ = read_document(spec_file)
    return document


def _evaluate(document: dict, settings: Sequence[Setting], point: dict[str, Any], input_size, on_point,
              done: int, total: int) -> SweepPoint:
    """One point: apply its settings to a copy of the document, validate it and count it."""
    empty = SweepPoint(point)
    if on_point is not None:
        on_point(empty.label, done, total)
    changed = copy.deepcopy(document)
    for setting in settings:
        assign(changed, setting, copy.deepcopy(point[setting.path]))
    try:
        return SweepPoint(point, stats=stats(load_spec(changed), input_size=input_size))
    except SpecError as error:
        return SweepPoint(point, problems=tuple(str(p) for p in error.problems))
    except MoespecError as error:
        return SweepPoint(point, problems=(str(error),))


def pareto_front(points: Sequence[SpecStats]) -> list[int]:
    """Indices of the points no other point beats on both axes: as many parameters or more, at as few
    activated GMACs or fewer (and better on one). The designs that buy the most capacity for their compute."""
    front = []
    for i, p in enumerate(points):
        dominated = any(q.total_params >= p.total_params and q.gmacs <= p.gmacs
                        and (q.total_params > p.total_params or q.gmacs < p.gmacs) for q in points)
        if not dominated:
            front.append(i)
    return front


def plot(points: Sequence[SweepPoint], output: Path, title: str) -> Path:
    """Draw the valid points (activated GMACs against total parameters), their Pareto front and the dense
    backbone to `output`."""
    valid = [p for p in points if p.stats is not None]
    records = [p.stats for p in valid]
    paths = list(valid[0].settings) if valid else []
    dots = [(", ".join(show(v) for v in p.settings.values()), s.total_params / 1e6, s.gmacs)
            for p, s in zip(valid, records, strict=True)]
    dense = {(s.backbone, s.dense_params, round(s.dense_gmacs, 6)) for s in records}
    stars = [(f"dense {name}", params / 1e6, gmacs) for name, params, gmacs in sorted(dense)]
    title = f"{title}\npoint labels: {', '.join(_short_names(paths).values())}"
    return save_figure(sweep_figure(title, dots, pareto_front(records), stars), output)


def _short_names(paths: list[str]) -> dict[str, str]:
    """The last part of each path (`experts`), or the whole path where two would share a last part."""
    last = [p.split(".")[-1] for p in paths]
    return {p: (name if last.count(name) == 1 else p) for p, name in zip(paths, last, strict=True)}

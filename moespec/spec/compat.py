"""The one compatibility step between spec releases: specs of the previous release validate unchanged.

Release 0.1 wrote the router settings `top_k` and `capacity_factor` on the surgery group:

    moe:                                      moe:
      - where: {every: 2}                       - where: {every: 2}
        experts: 8                   ->           experts: 8
        top_k: 2                                  router: {kind: topk, top_k: 2, capacity_factor: 1.25}
        capacity_factor: 1.25
        router: {kind: topk}

They belong to the router kinds that read them now. `upgrade_group` moves them into the group's `router:`
before validation, so every earlier spec (a file, a checkpoint's embedded spec, a Python dict) gives the
same `Spec` as its new form; `document_loc` points an error about a moved setting at the line the file has
it on; `upgraded_text` is `moespec validate --fix`: the file in the new form, comments and layout kept.
"""

from __future__ import annotations

from typing import Any

import yaml

from .registry import ROUTER_KINDS, FieldError

MOVED_TO_ROUTER = ("top_k", "capacity_factor")
"""Surgery-group keys of release 0.1 that are router settings now."""
_OLD_DEFAULTS = {("top_k", 1, int), ("capacity_factor", None, type(None))}
"""Their release 0.1 defaults, which that release wrote out beside any router (`Spec.to_yaml`, checkpoints)."""

DEFAULT_ROUTER_KIND = "topk"
"""A `router:` mapping without `kind` (and a group without `router:`) is a top-k router."""


def router_kind_of(value: Any) -> str | None:
    """The `kind` of a router mapping (default: top-k) or of a router spec model. A kind that is not a string
    (`kind: {every: 3}`, `kind: 3`) comes back as its text, an unknown kind: a mapping or list cannot be
    looked up (unhashable) and was a TypeError out of validation."""
    if not isinstance(value, dict):
        return getattr(value, "kind", None)
    kind = value.get("kind", DEFAULT_ROUTER_KIND)
    return kind if kind is None or isinstance(kind, str) else str(kind)


def upgrade_group(data: Any) -> Any:
    """A surgery group mapping with the release 0.1 keys moved into its router. On a router kind without the
    setting, that release's default (`top_k: 1`, `capacity_factor: null`) is dropped, and so is the
    `group: null` it wrote on every router; any other value is an error that says what to do, as that release
    said it."""
    if not isinstance(data, dict):
        return data
    router = {} if data.get("router") is None else data.get("router")
    spec = ROUTER_KINDS.get(router_kind_of(router)) if isinstance(router, dict) else None
    moved = {key: data[key] for key in MOVED_TO_ROUTER if key in data}
    stale_group = spec is not None and router.get("group", "") is None and "group" not in spec.model_fields
    if not (moved or stale_group):
        return data
    data = {key: value for key, value in data.items() if key not in moved}
    if spec is None:  # not a router mapping, or an unknown kind: validation reports that
        return data
    router = {key: value for key, value in router.items() if not (stale_group and key == "group")}
    for key, value in moved.items():
        if key in router:
            raise FieldError(key, f"{key} is given twice, here and as router.{key}; keep router.{key} and remove "
                                  f"this one")
        if key in spec.model_fields:
            router[key] = value
        elif (key, value, type(value)) not in _OLD_DEFAULTS:
            raise FieldError(key, _not_taken(key, value, router_kind_of(router), spec))
    return {**data, "router": router}


def _not_taken(key: str, value: Any, kind: str, spec: type) -> str:
    instead = "set router.capacity instead" if "capacity" in spec.model_fields else ""
    if key == "top_k":
        return f"top_k ({value}) does not apply to {kind} routers; remove top_k" + (instead and f" and {instead}")
    takers = ", ".join(name for name, other in ROUTER_KINDS.items() if key in other.model_fields)
    return f"{key} applies to {takers} routers only, not {kind}; {instead or 'remove it'}"


def document_loc(loc: tuple, data: Any) -> tuple:
    """Where a pydantic error about a router setting is in a document: `moe.0.router.top_k` is at `moe.0.top_k`
    in a file of release 0.1 that says it there."""
    if len(loc) < 4 or loc[0] != "moe" or not isinstance(loc[1], int) or loc[2] != "router":
        return loc
    try:
        group = data["moe"][loc[1]]
    except (KeyError, IndexError, TypeError):
        return loc
    router = group.get("router") if isinstance(group, dict) else None
    for depth, part in enumerate(loc[3:5], start=3):
        if part in MOVED_TO_ROUTER and part in group and not (isinstance(router, dict) and part in router):
            return ("moe", loc[1], part, *loc[depth + 1:])
    return loc


class CannotRewrite(Exception):
    """`upgraded_text` cannot move a key without losing what the file says around it."""


def upgraded_text(text: str) -> str:
    """The spec file `text` in the new form: each group's release 0.1 keys moved into its `router:` mapping,
    with every comment, blank line and the order of the other keys kept. Groups must be block mappings (one
    key per line, the form every shipped and documented spec has); anything else raises `CannotRewrite`."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    groups = _value(root, "moe")
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement) in `text`
    for group in groups.value if isinstance(groups, yaml.SequenceNode) else []:
        if not isinstance(group, yaml.MappingNode):
            continue
        moved = [(key, value) for key, value in group.value if key.value in MOVED_TO_ROUTER]
        if not moved:
            continue
        if group.flow_style:
            raise CannotRewrite(f"line {group.start_mark.line + 1}: a surgery group in flow style ({{...}})")
        lines = [_own_line(text, key, value) for key, value in moved]
        settings = [f"{key.value}: {text[value.start_mark.index:value.end_mark.index]}" for key, value in moved]
        comments = [comment for _, _, comment in lines if comment]
        router = _value(group, "router")
        if router is None:
            indent = " " * moved[0][0].start_mark.column
            comment = f"  {'; '.join(comments)}" if comments else ""
            edits.append((lines[0][0], lines[0][1], f"{indent}router: {{{', '.join(settings)}}}{comment}\n"))
            edits += [(start, end, "") for start, end, _ in lines[1:]]
            continue
        edits += [(start, end, "") for start, end, _ in lines]
        edits += _into_router(text, router, settings, comments)
    for start, end, replacement in sorted(edits, reverse=True):
        text = text[:start] + replacement + text[end:]
    return text


def _value(mapping: Any, name: str) -> Any:
    if not isinstance(mapping, yaml.MappingNode):
        return None
    return next((value for key, value in mapping.value if key.value == name), None)


def _own_line(text: str, key: Any, value: Any) -> tuple[int, int, str]:
    """The span of the lines `key: value` fills (newline included) and its trailing comment; refused where the
    line holds more than the key (`- top_k: 2`, the group's first key)."""
    start = text.rfind("\n", 0, key.start_mark.index) + 1
    end = text.find("\n", value.end_mark.index)
    end = len(text) if end < 0 else end + 1
    rest = text[value.end_mark.index:end].strip()
    if text[start:key.start_mark.index].strip() or (rest and not rest.startswith("#")):
        raise CannotRewrite(f"line {key.start_mark.line + 1}: {key.value} shares its line with other keys")
    return start, end, rest


def _into_router(text: str, router: Any, settings: list[str], comments: list[str]) -> list[tuple[int, int, str]]:
    """The edits that put `settings` into the router mapping, after its `kind` (first where it has none): inside
    its braces, or as lines of its block; the moved lines' comments go to the end of the router's line."""
    if not isinstance(router, yaml.MappingNode):
        raise CannotRewrite(f"line {router.start_mark.line + 1}: router is not a mapping")
    kind = next((value for key, value in router.value if key.value == "kind"), None)
    if router.flow_style:
        if kind is not None:
            edits = [(kind.end_mark.index, kind.end_mark.index, "".join(f", {setting}" for setting in settings))]
        elif router.value:
            first = router.value[0][0].start_mark.index
            edits = [(first, first, "".join(f"{setting}, " for setting in settings))]
        else:
            close = text.rindex("}", router.start_mark.index, router.end_mark.index)
            edits = [(close, close, ", ".join(settings))]
        line_end = text.find("\n", router.end_mark.index)
        line_end = len(text) if line_end < 0 else line_end
        if comments and "#" not in text[router.end_mark.index:line_end]:
            edits.append((line_end, line_end, f"  {'; '.join(comments)}"))
        return edits
    indent = " " * router.value[0][0].start_mark.column
    lines = [f"{indent}{setting}" for setting in settings]
    if comments:
        lines[-1] += f"  {'; '.join(comments)}"
    if kind is not None:
        end = text.find("\n", kind.end_mark.index)
        end = len(text) if end < 0 else end
        return [(end, end, "".join(f"\n{line}" for line in lines))]
    start = text.rfind("\n", 0, router.value[0][0].start_mark.index) + 1
    return [(start, start, "".join(f"{line}\n" for line in lines))]

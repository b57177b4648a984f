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

import re
from typing import Any

import yaml

from .registry import ROUTER_KINDS, FieldError, RouterSpec

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
    if isinstance(router, RouterSpec) and any(key in data for key in MOVED_TO_ROUTER):
        router = _as_mapping(router)  # a spec object: merged, or refused, as its mapping would be
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


def _as_mapping(router: RouterSpec) -> dict[str, Any]:
    """A router spec object as the mapping that gives it: its kind and the settings it was given (the others
    keep their defaults), so that a group's release 0.1 key set beside it is merged or refused alike."""
    return {"kind": router.kind, **router.model_dump(include=set(router.model_fields_set))}


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
    """The spec file `text` in the new form: each group's release 0.1 keys moved into its `router:` mapping
    (or dropped where the router's kind does not take them and they hold that release's default, with the
    `group: null` it wrote on such routers, as `upgrade_group` reads them), with every comment, blank line,
    line ending and the order of the other keys kept. Groups must be block mappings (one key per line, the
    form every shipped and documented spec and `Spec.to_yaml` has), each with a router of its own; anything
    else raises `CannotRewrite`."""
    newline = "\r\n" if "\r\n" in text else "\n"  # new lines end as the file's lines do
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    groups = _value(root, "moe")
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement) in `text`
    routers = [id(_value(group, "router")) for group in groups.value] if isinstance(groups, yaml.SequenceNode) else []
    for group in groups.value if isinstance(groups, yaml.SequenceNode) else []:
        if not isinstance(group, yaml.MappingNode):
            continue
        router = _value(group, "router")
        kind = ROUTER_KINDS.get(_kind_text(router))
        moved = [(key, value) for key, value in group.value if key.value in MOVED_TO_ROUTER]
        stale = [(key, value) for key, value in (router.value if isinstance(router, yaml.MappingNode) else [])
                 if key.value == "group" and value.tag.endswith(":null") and kind is not None
                 and "group" not in kind.model_fields]
        if not (moved or stale):
            continue
        if group.flow_style:
            raise CannotRewrite(f"line {group.start_mark.line + 1}: a surgery group in flow style ({{...}})")
        if router is not None and routers.count(id(router)) > 1:
            raise CannotRewrite(f"line {_key_of(group, 'router').start_mark.line + 1}: this group's router is also "
                                f"another group's (an &anchor and its *alias); write each router out in full")
        lines = [_own_line(text, key, value) for key, value in moved]
        taken = [(key, value) for key, value in moved if kind is None or key.value in kind.model_fields]
        settings = [f"{key.value}: {text[value.start_mark.index:value.end_mark.index]}" for key, value in taken]
        comments = [comment for _, _, found in lines for comment in found]
        edits += [(start, end, "") for start, end, _ in lines]
        if router is None:
            indent = " " * moved[0][0].start_mark.column
            comment = f"  {'; '.join(comments)}" if comments else ""
            edits.append((lines[0][0], lines[0][0], f"{indent}router: {{{', '.join(settings)}}}{comment}{newline}"))
            continue
        edits += [_removed(text, router, key, value) for key, value in stale]
        edits += _into_router(text, router, settings, comments, newline)
    for start, end, replacement in sorted(edits, key=lambda edit: (edit[0], edit[1]), reverse=True):
        text = text[:start] + replacement + text[end:]
    return text


def _value(mapping: Any, name: str) -> Any:
    key = _key_of(mapping, name)
    return None if key is None else next(value for k, value in mapping.value if k is key)


def _key_of(mapping: Any, name: str) -> Any:
    if not isinstance(mapping, yaml.MappingNode):
        return None
    return next((key for key, _ in mapping.value if key.value == name), None)


def _kind_text(router: Any) -> str | None:
    """The kind a router node names (`kind:`'s text, top-k without one); None for a router that is no mapping."""
    if router is None:
        return DEFAULT_ROUTER_KIND
    if not isinstance(router, yaml.MappingNode):
        return None
    kind = _value(router, "kind")
    return kind.value if isinstance(kind, yaml.ScalarNode) else DEFAULT_ROUTER_KIND if kind is None else None


_COMMENT = re.compile(r"#[^\r\n]*")


def _line_end(text: str, index: int) -> int:
    """Where the line holding `index` ends: before its `\r\n` or `\n` (or at the end of the text)."""
    end = text.find("\n", index)
    end = len(text) if end < 0 else end
    return end - 1 if end > index and text[end - 1] == "\r" else end


def _own_line(text: str, key: Any, value: Any) -> tuple[int, int, list[str]]:
    """The span of the lines `key: value` fills (line break included) and every comment in it (after the
    value, or after the key where the value is on the next line); refused where the lines hold more than the
    key (`- top_k: 2`, the group's first key, or a tag or anchor)."""
    start = text.rfind("\n", 0, key.start_mark.index) + 1
    end = text.find("\n", value.end_mark.index)
    end = len(text) if end < 0 else end + 1
    around = text[key.end_mark.index:value.start_mark.index] + " " + text[value.end_mark.index:end]
    comments = _COMMENT.findall(around)
    rest = _COMMENT.sub("", around).replace(":", "", 1).strip()
    if text[start:key.start_mark.index].strip() or rest:
        raise CannotRewrite(f"line {key.start_mark.line + 1}: {key.value} shares its line with other keys")
    return start, end, [comment.rstrip() for comment in comments]


def _removed(text: str, router: Any, key: Any, value: Any) -> tuple[int, int, str]:
    """The edit that removes `key: value` from the router mapping: its own line in a block (refused with a
    comment on it), its entry between the braces of a flow mapping."""
    if not router.flow_style:
        start, end, comments = _own_line(text, key, value)
        if comments:
            raise CannotRewrite(f"line {key.start_mark.line + 1}: a comment on router.{key.value}, which goes")
        return start, end, ""
    index = next(i for i, (k, _) in enumerate(router.value) if k is key)
    if index > 0:  # from the end of the entry before it: ", group: null"
        return router.value[index - 1][1].end_mark.index, value.end_mark.index, ""
    if len(router.value) > 1:  # the first of several: "group: null, "
        return key.start_mark.index, router.value[1][0].start_mark.index, ""
    return key.start_mark.index, value.end_mark.index, ""


def _into_router(text: str, router: Any, settings: list[str], comments: list[str], newline: str
                 ) -> list[tuple[int, int, str]]:
    """The edits that put `settings` into the router mapping, after its `kind` (first where it has none): inside
    its braces, or as lines of its block; the moved lines' comments go to the end of the router's line (after
    any comment it has), or of the last moved setting's line."""
    if not isinstance(router, yaml.MappingNode):
        raise CannotRewrite(f"line {router.start_mark.line + 1}: router is not a mapping")
    kind = _value(router, "kind")
    edits = []
    if router.flow_style or not router.value:
        if not settings:
            pass
        elif kind is not None:
            edits = [(kind.end_mark.index, kind.end_mark.index, "".join(f", {setting}" for setting in settings))]
        elif router.value:
            first = router.value[0][0].start_mark.index
            edits = [(first, first, "".join(f"{setting}, " for setting in settings))]
        else:
            close = text.rindex("}", router.start_mark.index, router.end_mark.index)
            edits = [(close, close, ", ".join(settings))]
        if comments:
            line_end = _line_end(text, router.end_mark.index)
            edits.append((line_end, line_end, f"  {'; '.join(comments)}"))
        return edits
    indent = " " * router.value[0][0].start_mark.column
    lines = [f"{indent}{setting}" for setting in settings]
    if comments and lines:
        lines[-1] += f"  {'; '.join(comments)}"
    elif comments:  # nothing moves in (defaults dropped): the comments go to the router key's line
        line_end = _line_end(text, router.start_mark.index - 1)
        return [(line_end, line_end, f"  {'; '.join(comments)}")]
    if kind is not None:
        end = _line_end(text, kind.end_mark.index)
        return [(end, end, "".join(f"{newline}{line}" for line in lines))]
    start = text.rfind("\n", 0, router.value[0][0].start_mark.index) + 1
    return [(start, start, "".join(f"{line}{newline}" for line in lines))]

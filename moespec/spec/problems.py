"""Pydantic's validation errors, translated into located `Problem`s: one per field, at the YAML node it is
about, in words that say what is allowed."""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel

from ..errors import Problem, did_you_mean, field_path
from .compat import document_loc, router_kind_of, upgrade_group
from .models import Spec
from .registry import ROUTER_KINDS, SELECTORS, FieldError
from .yaml_positions import Positions


def merge_alternatives(problems: list[Problem]) -> list[Problem]:
    """One problem per field: a value that fits no member of a union (`noise: -1` is neither a bool nor a float
    >= 0) gets one message listing what each member wanted."""
    merged: dict[tuple, list[Problem]] = {}
    for problem in problems:
        merged.setdefault((problem.path, problem.file, problem.line, problem.column), []).append(problem)
    out = []
    for same in merged.values():
        messages = list(dict.fromkeys(p.message for p in same))
        if len(messages) > 1 and all(m.startswith("input should be ") for m in messages):
            wanted = [re.sub(r", (unable to|got) .*$", "", m.removeprefix("input should be ")) for m in messages]
            messages = ["input should be " + " or ".join(wanted)]
        out.append(dataclasses.replace(same[0], message="; or ".join(messages)))
    return out


def hidden_cross_field_problems(data: Any, problems: list[Problem], positions: Positions,
                                file: str | None) -> list[Problem]:
    """The cross-field checks that a value error elsewhere in the same router kept pydantic from running: a
    router with `score: sigmod` is not validated, so its `top_k: 5` over 4 experts went unreported.
    Each such router is validated again without its keys in error, and checked against the group's `experts`
    when those are valid; what that finds is reported beside the value errors."""
    found = []
    groups = data.get("moe") if isinstance(data, dict) else None
    for index, group in enumerate(groups if isinstance(groups, list) else []):
        try:
            group = upgrade_group(group) if isinstance(group, dict) else {}
        except ValueError:  # release 0.1's keys that do not move: reported already
            continue
        router, experts = group.get("router"), group.get("experts")
        prefix = f"moe.{index}.router."
        bad = {p.path.removeprefix(prefix).split(".")[0] for p in problems if p.path.startswith(prefix)}
        if not bad or not isinstance(router, dict) or any(p.path == f"moe.{index}.experts" for p in problems):
            continue
        spec = ROUTER_KINDS.get(router_kind_of(router)) if "kind" not in bad else None
        if spec is None or type(experts) is not int:
            continue
        try:
            spec.model_validate({k: v for k, v in router.items() if str(k) not in bad}).check_experts(experts)
        except FieldError as error:
            path = ["moe", index, "router", *error.field.split(".")]
            line, column = positions.find(path)
            found.append(Problem(str(error), path=field_path(path), file=file, line=line, column=column))
        except ValueError:  # a router not valid without its bad keys either: their own problems say enough
            continue
    return found


def yaml_kind(value: Any) -> str:
    """What a YAML value is, in YAML's words: `a string`, `a list`, ..."""
    words = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "a mapping", type(None): "null"}
    return words.get(type(value), f"a {type(value).__name__}")


def _node(data: Any, path: list[Any]) -> Any:
    for part in path:
        data = data[part] if isinstance(data, (dict, list)) else None
    return data


def problem(error: dict, data: Any, positions: Positions, file: str | None) -> Problem:
    """Turn one pydantic error into a Problem at the YAML node it is about.

    Pydantic's `loc` also names union members (`topk`, `every`, `list[...]`); those are not keys of the
    document, so we keep only the parts that walk the data.
    """
    path: list[Any] = []
    node = data
    loc = error["loc"]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):  # a cross-field check about a field inside the validated one
        loc = (*loc, *cause.field.split("."))
    tag_seen = False
    for part in document_loc(loc, data):
        if path and path[-1] == "router" and not tag_seen and isinstance(node, dict) and part == node.get("kind"):
            tag_seen = True  # the union's tag, not a key: `router: {kind: topk, topk: 2}` has a key named like it
            continue
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, dict) and str(part) in {str(k) for k in node}:
            key = next(k for k in node if str(k) == str(part))
            node, part = node[key], key
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif error["type"] in ("extra_forbidden", "missing") and part == loc[-1]:
            pass  # the key itself: unknown, or absent
        else:
            continue
        path.append(part)
    message = _message(error, path, data)
    line, column = positions.find(path)
    return Problem(message, path=field_path(path), file=file, line=line, column=column)


def _message(error: dict, path: list[Any], data: Any) -> str:
    kind, msg = error["type"], error["msg"]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(Spec, path[:-1], _node(data, path[:-1]))
        hint = did_you_mean(path[-1], allowed) if allowed else ""
        owners = [name for name, spec in ROUTER_KINDS.items() if path[-1] in spec.model_fields]
        if len(path) >= 2 and path[-2] == "router" and owners and not hint:
            hint = f"; {path[-1]} is a setting of {', '.join(owners)} routers"
        return f"unknown key {path[-1]!r}; allowed: {', '.join(allowed)}{hint}"
    if kind == "missing":
        return "this field is required"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if kind == "model_type":
        return f"expected a mapping (key: value), got {yaml_kind(error.get('input'))}"
    if kind == "union_tag_not_found":  # a router that is not a mapping
        value = error.get("input")
        hint = (f"did you mean {{kind: {value}}}?" if isinstance(value, str) and value in ROUTER_KINDS
                else f"e.g. {{kind: topk}}; kinds: {', '.join(ROUTER_KINDS)}")
        return f"expected a mapping (key: value), got {yaml_kind(value)}; {hint}"
    if kind == "selector" and isinstance(error.get("input"), dict) and len(error["input"]) == 1:
        return msg + did_you_mean(next(iter(error["input"])), SELECTORS)
    if kind == "union_tag_invalid":
        tag, expected = error["ctx"]["tag"], error["ctx"]["expected_tags"]
        hint = did_you_mean(tag, re.findall(r"'([^']*)'", expected))
        return f"unknown {path[-1] if path else 'kind'} {tag!r}; allowed: {expected}{hint}"
    message = msg[0].lower() + msg[1:] if msg else kind
    if kind == "literal_error":
        message += did_you_mean(error.get("input"), re.findall(r"'([^']*)'", error["ctx"]["expected"]))
    return message


def _leaf_types(annotation: Any) -> list[Any]:
    """Unwrap Annotated / Optional / Union into the types a value may have."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _leaf_types(get_args(annotation)[0])
    if origin is Union:
        return [t for arg in get_args(annotation) for t in _leaf_types(arg)]
    return [annotation]


def _unwrapped(candidates: list[Any], lists: bool) -> list[Any]:
    """The leaf types of `candidates`; with `lists`, a list type stands for its items (a spec may give one
    mapping where a list is expected: `rescale: {where: ...}`)."""
    leaves = [leaf for c in candidates for leaf in _leaf_types(c)]
    return [item for t in leaves
            for item in (_leaf_types(get_args(t)[0]) if lists and get_origin(t) is list else [t])]


def allowed_keys(path: list[Any], node: Any = None) -> list[str]:
    """The keys the mapping at `path` (keys and list indices) of a spec document may have; [] where any key
    goes (`backbone.kwargs`). `node`, the mapping itself, picks the router by its `kind`."""
    keys = _allowed_keys(Spec, path, node)
    if not keys and isinstance(node, dict):  # a one-or-list field written as its one item (`where: {every: 2}`)
        keys = _allowed_keys(Spec, [*path, 0], node)
    return keys


def _allowed_keys(model: type[BaseModel], path: list[Any], node: Any = None) -> list[str]:
    """The keys the mapping `node` at `path` of the document may have, found by walking the spec's types;
    among the members of a `kind`-discriminated union, only the one `node` names."""
    candidates: list[Any] = [model]
    for part in path:
        following = []
        for t in _unwrapped(candidates, lists=not isinstance(part, int)):
            if isinstance(t, type) and issubclass(t, BaseModel) and str(part) in t.model_fields:
                following.append(t.model_fields[str(part)].annotation)
            elif get_origin(t) is list:
                following.append(get_args(t)[0])
            elif get_origin(t) is dict:
                following.append(get_args(t)[1])
        candidates = following
    models = [t for t in _unwrapped(candidates, lists=True) if isinstance(t, type) and issubclass(t, BaseModel)]
    if isinstance(node, dict) and models and all("kind" in m.model_fields for m in models):
        kind = node.get("kind", models[0].model_fields["kind"].default)
        models = [m for m in models if kind in get_args(m.model_fields["kind"].annotation)] or models
    keys: list[str] = []
    for m in models:
        keys += [k for k in m.model_fields if k not in keys]
    return keys


"""The two extension tables of the spec language: selectors (`where: {every: 2}`) and router kinds
(`router: {kind: topk}`). Each is a dict filled by a decorator; registering after import works, because the
spec models that list them are rebuilt on every registration (see `spec.models`).

A router kind is one `RouterKind` entry: its spec model plus everything the later stages need to know about
it, so that no stage branches on `kind`. The built-in kinds live in `moespec/routers/`, one file each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal, Optional, Union, get_args

from .fields import IntRange, SpecModel

SELECTORS: dict[str, type] = {}
"""YAML key -> selector model (`spec.selectors.Selector`)."""

ROUTER_KINDS: dict[str, "RouterKind"] = {}
"""`router.kind` -> its RouterKind, in registration order (the order of the JSON Schema's `oneOf`)."""

_listeners: list[Callable[[], None]] = []


def on_register(listener: Callable[[], None]) -> None:
    """Call `listener()` after every registration (the spec models rebuild their selector and router fields)."""
    _listeners.append(listener)


def _changed() -> None:
    for listener in _listeners:
        listener()


def register_selector(key: str) -> Callable[[type], type]:
    """Register a selector model under the single YAML key that introduces it."""

    def wrap(cls: type) -> type:
        SELECTORS[key] = cls
        _changed()
        return cls

    return wrap


def unregister_selector(key: str) -> None:
    """Take a selector out of the spec language again (a plug-in's tests register and remove their own)."""
    SELECTORS.pop(key)
    _changed()


MAX_GROUP_IMAGES = 1_048_576
"""Images per routing group (2**20): more than any batch; V-MoE groups a device's batch (Riquelme et al. 2021)."""


class RouterSpec(SpecModel):
    """Base of every `router:` mapping. The class attributes say how the kind combines with the surgery
    group's other fields; `MoEGroup` checks them, so its errors name the right field."""

    kind: str
    group: Optional[Union[Literal["image", "batch"], IntRange(1, MAX_GROUP_IMAGES)]] = None
    """The routing group, within which capacity, priority and drops are decided: `image` (the default) routes
    each image alone, so its prediction does not depend on the rest of its batch; N, groups of N consecutive
    images (V-MoE's group_size); `batch`, the whole batch."""
    title: ClassVar[str] = ""  # how people call it: "top-k", "expert choice", "Soft MoE"
    takes_top_k: ClassVar[bool] = True  # `top_k` other than 1 is allowed
    takes_capacity_factor: ClassVar[bool] = False  # the group's `capacity_factor` applies
    load_balanced: ClassVar[bool] = True  # has aux losses (default: one importance_load loss)
    instead: ClassVar[str] = ""  # the field to use instead of top_k / capacity_factor, if any

    def check_group(self, group: Any) -> None:
        """Cross-field checks with the whole validated group; raise ValueError with the fix."""

    def group_cannot_matter(self, group: Any) -> str:
        """Why `group` cannot change this router's decisions in the surgery group `group` ("" if it can)."""
        return ""


@dataclass(frozen=True)
class Inspection:
    """What `moespec inspect` counts for a router kind, per class and expert."""

    unit: str  # a heatmap row counts "token"s or "image"s
    name: Callable[[int], str]  # top_k -> how the report names the router: "top-2", "Soft MoE"
    share_label: str  # the heatmap's colour bar
    tally: Callable[[Any], tuple[Any, float]]  # MoE module after a forward -> ([B, E] float64 mass, items dropped)


@dataclass(frozen=True)
class RouterKind:
    """One router kind, complete. `router` below is the plan's plain copy of the spec model (a dict of numbers
    and strings, nested `gate` included); `layer` a `planning.LayerPlan`.

    spec:      the `router:` mapping; its `kind` field's Literal names the kind.
    build:     (router, layer, experts, shared) -> the MoE module that replaces the FFN.
    describe:  (router, layer) -> the short text of `moespec plan`'s router column.
    caveats:   (router, layer) -> why an upcycled layer may not compute its dense FFN, one line each.
    activated: (router, layer) -> (routed experts one item uses, what an item is) for activated params. MACs
               are the built module's `activated_macs` / `executed_macs`: it knows what it runs.
    inspect:   what `moespec inspect` counts.
    resolve:   (router, the dense model's `BackboneSketch`, its timm name) -> the router with the defaults that
               depend on the model filled in; a `SpecError` whose problems name fields of the router (`pool`)
               when the model does not fit.
    """

    spec: type[RouterSpec]
    build: Callable[[dict, Any, Any, Any], Any]
    describe: Callable[[dict, Any], str]
    caveats: Callable[[dict, Any], list[str]]
    activated: Callable[[dict, Any], tuple[float, str]]
    inspect: Inspection
    resolve: Callable[[dict, Any, str], dict] = lambda router, sketch, name: router


def register_router_kind(kind: RouterKind) -> RouterKind:
    """Add (or replace) a router kind; its spec model joins the `router:` union at once."""
    (name,) = get_args(kind.spec.model_fields["kind"].annotation)
    ROUTER_KINDS[name] = kind
    _changed()
    return kind


def unregister_router_kind(name: str) -> None:
    """Take a router kind out of the `router:` union again."""
    ROUTER_KINDS.pop(name)
    _changed()


def router_kind(name: str) -> RouterKind:
    """The RouterKind of `name`; an unknown name says which kinds exist."""
    try:
        return ROUTER_KINDS[name]
    except KeyError:
        raise KeyError(f"unknown router kind {name!r}; registered: {', '.join(ROUTER_KINDS)}") from None

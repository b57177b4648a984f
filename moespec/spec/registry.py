"""The two extension tables of the spec language: selectors (`where: {every: 2}`) and router kinds
(`router: {kind: topk}`). Each is a dict filled by a decorator; registering after import works, because the
spec models that list them are rebuilt on every registration (see `spec.models`).

A router kind is one `RouterSpec` subclass: its settings and everything the later stages ask of it, so that no
stage branches on `kind`. The built-in kinds live in `moespec/routers/`, one file each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, get_args

from .fields import SpecModel

SELECTORS: dict[str, type] = {}
"""YAML key -> selector model (`spec.selectors.Selector`)."""

ROUTER_KINDS: dict[str, type["RouterSpec"]] = {}
"""`router.kind` -> its spec class, in registration order (the order of the JSON Schema's `oneOf`)."""

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


class FieldError(ValueError):
    """A cross-field check's error about `field`, a field inside the one being validated (`top_k` of the router
    a surgery group checks against its `experts`): the problem is reported at that field, not at its parent."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Inspection:
    """What `moespec inspect` counts for a router kind, per class and expert."""

    unit: str  # a heatmap row counts "token"s or "image"s
    share_label: str  # the heatmap's colour bar
    tally: Callable[[Any], tuple[Any, float]]  # MoE module after a forward -> ([B, E] float64 mass, items dropped)


class RouterSpec(SpecModel):
    """One router kind, complete: the `router:` mapping (its `kind` field's Literal names the kind, its fields
    are every setting the kind reads) and what every later stage asks of it, so that no stage branches on
    `kind` or reads a setting by name. The plan carries the validated object unchanged to the builder, the
    counters and `inspect`. `layer` below is the `planning.LayerPlan` of one MoE layer.

    A kind overrides `build` and `describe`, and whichever of the others differ from the defaults. Methods
    that build modules import torch inside (see `moespec/routers/__init__.py`).
    """

    kind: str
    title: ClassVar[str] = ""  # how people call it: "top-k", "expert choice", "Soft MoE"
    load_balanced: ClassVar[bool] = True  # has aux losses (default: one importance_load loss)
    rows_per_expert: ClassVar[bool] = True  # a gate row per expert, which `upcycle.router_init` may start from data
    fixed_experts: ClassVar[str] = ""  # why `moespec prune` / `merge` cannot remove its experts ("" where they can)
    whole_images: ClassVar[bool] = False  # every position of an image goes to the same experts (image routing)
    inspection: ClassVar[Inspection]

    def resolve(self, sketch: Any, model: str) -> "RouterSpec":
        """This router with the defaults that depend on the dense model (its `BackboneSketch`, timm name
        `model`) filled in; a `SpecError` whose problems name fields of the router when the model does not fit."""
        return self

    def check_experts(self, num_experts: int) -> None:
        """Checks against the surgery group's routed expert count; raise a `FieldError` with the fix."""

    def check_items(self, layer: Any, items_per_image: int) -> None:
        """Checks against the items one image routes through the layer, known once the model has been traced (at
        `moespec stats`); raise a `FieldError` with the fix."""

    def build(self, layer: Any, experts: Any, shared: Any) -> Any:
        """The MoE module (a `layers.MoELayer`) that replaces the FFN, around the expert banks `experts` and
        `shared` (None without shared experts)."""
        raise NotImplementedError(f"router kind {self.kind!r} does not build a module")

    def describe(self, layer: Any) -> str:
        """The router column of `moespec plan`: `topk/linear norm`, `soft p=1`."""
        raise NotImplementedError(f"router kind {self.kind!r} has no description")

    def activated_unit(self) -> str:
        """What one routed item is, beside the activated parameters: `per token`, `per image`."""
        return "per token"

    def picks(self) -> int:
        """The `k` column of `moespec plan` and the stats' `top_k`: the experts an item picks. Kinds whose items
        pick nothing (the experts pick in expert choice; Soft MoE mixes) show 1."""
        return 1

    def eval_picks(self) -> int:
        """`picks` in eval mode (`eval_top_k` where a kind has one)."""
        return self.picks()

    def report_name(self) -> str:
        """How `moespec inspect` names the router: `top-2`, `Soft MoE`."""
        return self.title

    def caveats(self, layer: Any) -> list[str]:
        """Why an upcycled layer may not compute its dense FFN, one line each ([] where it does)."""
        return []


def register_router_kind(spec: type[RouterSpec]) -> type[RouterSpec]:
    """Add (or replace) a router kind, as a class decorator; its spec model joins the `router:` union at once."""
    (name,) = get_args(spec.model_fields["kind"].annotation)
    ROUTER_KINDS[name] = spec
    _changed()
    return spec


def unregister_router_kind(name: str) -> None:
    """Take a router kind out of the `router:` union again."""
    ROUTER_KINDS.pop(name)
    _changed()

"""The spec: one frozen pydantic model per YAML mapping, and `load_spec` with file:line errors.

    name: vit-s16-moe8-every2-top2
    backbone: {model: vit_small_patch16_224, kwargs: {num_classes: 1000}}
    input_size: [3, 224, 224]
    moe:
      - where: {every: 2}
        experts: 8
        top_k: 2
    upcycle: {router_init: normal, noise: 0.0, split: slice}

The README's "Spec language" section documents every field; the models below are the single source of
truth for names, types and defaults.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, PrivateAttr, Tag, ValidationError,
                      ValidationInfo, field_validator, model_validator)

from .errors import Problem, SpecError, did_you_mean, field_path
from .selectors import SELECTORS, Where
from .yaml_positions import Positions, load_yaml

# Counts are strict: `experts: true` or `experts: 2.5` is an error, not 1 or 2. Factors are finite: `.inf`
# and `.nan` are YAML floats, but no width, capacity or weight.
PositiveInt = Annotated[int, Field(gt=0, strict=True)]
NonNegativeInt = Annotated[int, Field(ge=0, strict=True)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class SpecModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)  # docstrings: schema descriptions


class Backbone(SpecModel):
    """The dense timm model the surgery starts from."""

    model: Annotated[str, Field(min_length=1)]
    """Any timm model name, e.g. `vit_small_patch16_224`."""
    kwargs: dict[str, Any] = {}
    """Forwarded to `timm.create_model` (img_size, depth, embed_dim, num_classes, ...)."""
    checkpoint: Optional[str] = None
    """Local dense checkpoint (.safetensors/.pth/.bin) to upcycle from; relative paths are relative to the
    spec file."""
    pretrained: bool = False
    """Upcycle from timm's pretrained weights (needs a network)."""

    @field_validator("kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        reserved = {"pretrained", "checkpoint_path", "model_name"} & set(kwargs)
        if reserved:
            raise ValueError(
                f"{sorted(reserved)} cannot be passed through kwargs; use backbone.pretrained / "
                f"backbone.checkpoint instead"
            )
        return kwargs


class Gate(SpecModel):
    """How router logits are computed from an item (BRIEF.md §1).

    `linear`: `W_g x` (a 1x1 conv on feature maps). `cosine`: project x to `dim`, cosine similarity with
    learned per-expert codes, divided by `temperature` (Chi et al. 2022). `l2`: the same with the negative L2
    distance.
    """

    kind: Literal["linear", "cosine", "l2"] = "linear"
    dim: Optional[PositiveInt] = None
    """Projection width of cosine / l2 gates; default 16 (X-MoE)."""
    temperature: Optional[PositiveFloat] = None
    """Divides cosine / l2 logits; default 0.07."""

    @model_validator(mode="after")
    def _projection_only_for_cosine_l2(self) -> "Gate":
        if self.kind == "linear" and (self.dim is not None or self.temperature is not None):
            raise ValueError("dim and temperature apply to cosine and l2 gates only; remove them or use kind: cosine "
                             "or l2")
        return self


def _gate(value: Any) -> Any:
    """`gate: cosine` is short for `gate: {kind: cosine}`."""
    return {"kind": value} if isinstance(value, str) else value


GateSpec = Annotated[Gate, BeforeValidator(_gate, json_schema_input_type=Union[Literal["linear", "cosine", "l2"], Gate])]


class TopKRouter(SpecModel):
    """Token choice: every routed item picks its `top_k` experts (Shazeer et al. 2017)."""

    kind: Literal["topk"] = "topk"
    gate: GateSpec = Gate()
    normalize: bool = False
    """Renormalize the k selected gate values to sum to 1 (makes an upcycled model exactly dense)."""
    noise: Union[bool, NonNegativeFloat] = False
    """Noisy top-k (training only): `true` adds N(0, (1/E)^2) to the logits; a number sets the std."""
    bpr: bool = False
    """Batch prioritized routing: with a capacity factor, fill capacity by highest gate value, not position."""
    drop_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Importance-score routing (Sparse-MLP): the items with the lowest top-1 gate value, this fraction of
    them, are not dispatched at all."""


class ExpertChoiceRouter(SpecModel):
    """Expert choice (Zhou et al. 2022): each expert takes its top C = capacity * T / E items."""

    kind: Literal["expert_choice"]
    gate: GateSpec = Gate()
    capacity: PositiveFloat = 1.0
    """c: on average each item is processed by c experts."""


class SoftRouter(SpecModel):
    """Soft MoE (Puigcerver et al. 2024): every slot is a convex combination of all tokens of a sequence."""

    kind: Literal["soft"]
    slots_per_expert: PositiveInt = 1


class ImageRouter(SpecModel):
    """Image-level routing (ViMoE): one gate decision per image, from its [CLS] token or mean token."""

    kind: Literal["image"]
    gate: GateSpec = Gate()
    normalize: bool = False
    pool: Optional[Literal["cls", "mean"]] = None
    """Which vector the gate reads; default: `cls` where the model has a [CLS] token, else `mean`."""


ROUTER_SPECS = {"topk": TopKRouter, "expert_choice": ExpertChoiceRouter, "soft": SoftRouter, "image": ImageRouter}
"""Router kind -> its spec model; `layers.routers.ROUTERS` holds the matching modules."""


def _router_kind(value: Any) -> str | None:
    """The router's `kind`; a mapping without one is a `topk` router."""
    return value.get("kind", "topk") if isinstance(value, dict) else getattr(value, "kind", None)


Router = Annotated[
    Union[tuple(Annotated[cls, Tag(kind)] for kind, cls in ROUTER_SPECS.items())],  # type: ignore[misc]
    Discriminator(_router_kind),
]


class AuxLoss(SpecModel):
    """A load-balancing loss of the layer's last forward, added by `moespec.aux_loss(model)`."""

    kind: Literal["importance_load", "switch", "z_loss"] = "importance_load"
    weight: NonNegativeFloat = 0.01


def _as_list(value: Any) -> Any:
    """Accept one item where a list is expected: `aux_loss: {...}` means `aux_loss: [{...}]`."""
    return value if isinstance(value, list) else [value]


def OneOrList(item: Any) -> Any:
    """`list[item]` that also accepts a single `item`, in validation and in the JSON Schema."""
    return Annotated[list[item], BeforeValidator(_as_list, json_schema_input_type=Union[item, list[item]])]


class MoEGroup(SpecModel):
    """One surgery group: the FFN `sublayer` of each block picked by `where` becomes an MoE layer."""

    where: Where
    """Which blocks: one selector or a list of them (their union)."""
    sublayer: Annotated[str, Field(min_length=1)] = "mlp"
    experts: NonNegativeInt
    """Routed experts E. 0 means a plain (dense) MLP of width `expert_hidden`, only in blocks rebuilt by
    `rescale` (Sparse-MLP's "0 = plain MLP")."""
    top_k: PositiveInt = 1
    expert_hidden: Optional[PositiveInt] = None
    """Hidden width of each expert; default: the dense FFN's hidden width."""
    expert_mlp_ratio: Optional[PositiveFloat] = None
    """Hidden width as a multiple of the FFN's input width (alternative to `expert_hidden`)."""
    shared_experts: NonNegativeInt = 0
    """Always-active experts whose output is added to the routed output (ViMoE)."""
    router: Router = TopKRouter()
    capacity_factor: Optional[PositiveFloat] = None
    """topk only: each expert takes at most ceil(capacity_factor * top_k * T / experts) of T items;
    null = dropless."""
    aux_loss: OneOrList(AuxLoss) = [AuxLoss()]
    """One aux loss or a list of them; stored as a list."""

    @field_validator("top_k")
    @classmethod
    def _top_k_at_most_experts(cls, top_k: int, info: ValidationInfo) -> int:
        experts = info.data.get("experts")
        if experts and top_k > experts:
            raise ValueError(f"top_k ({top_k}) must be between 1 and experts ({experts})")
        return top_k

    @model_validator(mode="before")
    @classmethod
    def _soft_moe_has_no_aux_loss(cls, data: Any) -> Any:
        """Soft MoE needs no load balancing (BRIEF.md §5): its default aux loss is none."""
        if isinstance(data, dict) and _router_kind(data.get("router") or {}) == "soft" and "aux_loss" not in data:
            data = {**data, "aux_loss": []}
        return data

    # Cross-field checks sit on the later of the two fields, so that errors name a field, not the group.
    @field_validator("router")
    @classmethod
    def _router_takes_top_k(cls, router: Any, info: ValidationInfo) -> Any:
        top_k = info.data.get("top_k", 1)
        if router.kind in ("expert_choice", "soft") and top_k != 1:
            raise ValueError(f"top_k ({top_k}) does not apply to {router.kind} routers; remove top_k"
                             + (" and set router.capacity instead" if router.kind == "expert_choice" else ""))
        return router

    @field_validator("capacity_factor")
    @classmethod
    def _capacity_factor_for_topk(cls, factor: float | None, info: ValidationInfo) -> float | None:
        kind = getattr(info.data.get("router"), "kind", "topk")
        if factor is not None and kind != "topk":
            raise ValueError(f"capacity_factor applies to topk routers only, not {kind}; "
                             + ("set router.capacity instead" if kind == "expert_choice" else "remove it"))
        return factor

    @field_validator("aux_loss")
    @classmethod
    def _no_aux_loss_for_soft(cls, losses: list[AuxLoss], info: ValidationInfo) -> list[AuxLoss]:
        if losses and getattr(info.data.get("router"), "kind", None) == "soft":
            raise ValueError("Soft MoE has no load-balancing loss; remove aux_loss")
        return losses

    @model_validator(mode="after")
    def _bpr_has_capacity(self) -> "MoEGroup":
        if self.router.kind == "topk" and self.router.bpr and self.capacity_factor is None:
            raise ValueError("router.bpr (batch prioritized routing) needs a capacity_factor; set one, e.g. 1.25, "
                             "or remove bpr")
        return self

    @field_validator("expert_mlp_ratio")
    @classmethod
    def _one_width(cls, ratio: float | None, info: ValidationInfo) -> float | None:
        if ratio is not None and info.data.get("expert_hidden") is not None:
            raise ValueError("give expert_hidden or expert_mlp_ratio, not both")
        return ratio


class Upcycle(SpecModel):
    """How experts and routers start when a dense model is upcycled (Komatsuzaki et al. 2023)."""

    router_init: Literal["normal", "zeros"] = "normal"
    """`normal`: N(0, 0.02^2); `zeros`: all gates equal at the start."""
    noise: NonNegativeFloat = 0.0
    """Std of Gaussian noise added to each expert's copied weights, relative to each tensor's std."""
    split: Literal["slice", "partition"] = "slice"
    """For experts narrower than the dense FFN: `slice` gives every expert the leading hidden units,
    `partition` gives expert i its own block of units."""


class Rescale(SpecModel):
    """Sparse-MLP rescale (BRIEF.md §3): each selected block is rebuilt at [S1, C1] = [tokens * S, channels * C],
    wrapped by a pro-token rescale [S, C] -> [S1, C1] before it and a pro-channel rescale back after it."""

    where: Where
    tokens: PositiveFloat = 1.0
    """S1 / S."""
    channels: PositiveFloat = 1.0
    """C1 / C."""


def _channels_height_width(value: Any) -> Any:
    """`input_size` is written as a list of three; say so instead of pydantic's tuple errors."""
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ValueError("expected [channels, height, width], three positive integers, e.g. [3, 224, 224]")
    return value


class Spec(SpecModel):
    """A whole MoE model: a timm backbone and the surgery applied to it."""

    name: Optional[Annotated[str, Field(min_length=1)]] = None
    """Defaults to the spec file's stem."""
    backbone: Backbone
    input_size: Optional[Annotated[tuple[PositiveInt, PositiveInt, PositiveInt],
                                   BeforeValidator(_channels_height_width)]] = None
    """(channels, height, width); default: the backbone's pretrained_cfg input_size."""
    rescale: OneOrList(Rescale) = []
    """Blocks to rebuild at a rescaled shape (Sparse-MLP); one mapping or a list."""
    moe: list[MoEGroup] = []
    upcycle: Upcycle = Upcycle()
    aux_loss_in_backward: bool = False
    """Add every MoE layer's weighted aux loss to the gradients in backward (like Megatron's
    MoEAuxLossAutoScaler), for training loops that never call `moespec.aux_loss`; `moespec.aux_loss(model)`
    then returns the value detached, for logging, so adding it as well does not count it twice."""
    _source: Optional[str] = PrivateAttr(default=None)

    @property
    def source(self) -> str | None:
        """The file this spec was loaded from (not part of the YAML), or None."""
        return self._source

    def to_yaml(self) -> str:
        """The spec as YAML, with every default written out. `load_spec` reads it back to an equal Spec."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def resolve_path(self, path: str | Path) -> Path:
        """A path from the spec, relative to the spec file's folder."""
        path = Path(path).expanduser()
        if path.is_absolute() or self.source is None:
            return path
        return Path(self.source).parent / path


def load_spec(source: str | Path | dict, *, text: str | None = None) -> Spec:
    """Load and validate a spec from a YAML file (or a dict, or YAML `text` with `source` as its name).

    Every problem is reported at once, as `file:line:col: field.path: message`, in a `SpecError`.
    """
    if isinstance(source, dict):
        return _validate(source, Positions(), file=None)
    file = str(source)
    if text is None:
        path = Path(source)
        if not path.is_file():
            raise SpecError(Problem(f"no such spec file{'' if not path.is_dir() else ' (it is a folder)'}", file=file))
        text = path.read_text(encoding="utf-8")
    data, positions = load_yaml(text, file)
    if not isinstance(data, dict):
        found = "an empty file" if data is None else _yaml_kind(data)
        raise SpecError(Problem(f"a spec is a YAML mapping with at least 'backbone', but this is {found}", file=file, line=1, column=1))
    if data.get("name") is None:
        data["name"] = Path(file).stem
    return _validate(data, positions, file=file)


def _validate(data: dict, positions: Positions, file: str | None) -> Spec:
    try:
        spec = Spec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_merge_alternatives([_problem(e, data, positions, file) for e in err.errors()])) from None
    spec._source = file
    return spec


def _merge_alternatives(problems: list[Problem]) -> list[Problem]:
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


def _yaml_kind(value: Any) -> str:
    """What a YAML value is, in YAML's words: `a string`, `a list`, ..."""
    words = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "a mapping", type(None): "null"}
    return words.get(type(value), f"a {type(value).__name__}")


def _node(data: Any, path: list[Any]) -> Any:
    for part in path:
        data = data[part] if isinstance(data, (dict, list)) else None
    return data


def _problem(error: dict, data: Any, positions: Positions, file: str | None) -> Problem:
    """Turn one pydantic error into a Problem at the YAML node it is about.

    Pydantic's `loc` also names union members (`topk`, `every`, `list[...]`); those are not keys of the
    document, so we keep only the parts that walk the data.
    """
    path: list[Any] = []
    node = data
    for part in error["loc"]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, dict) and str(part) in {str(k) for k in node}:
            key = next(k for k in node if str(k) == str(part))
            node, part = node[key], key
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif error["type"] in ("extra_forbidden", "missing") and part == error["loc"][-1]:
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
        return f"unknown key {path[-1]!r}; allowed: {', '.join(allowed)}{hint}"
    if kind == "missing":
        return "this field is required"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if kind == "model_type":
        return f"expected a mapping (key: value), got {_yaml_kind(error.get('input'))}"
    if kind == "union_tag_not_found":  # a router that is not a mapping
        value = error.get("input")
        hint = (f"did you mean {{kind: {value}}}?" if isinstance(value, str) and value in ROUTER_SPECS
                else f"e.g. {{kind: topk}}; kinds: {', '.join(ROUTER_SPECS)}")
        return f"expected a mapping (key: value), got {_yaml_kind(value)}; {hint}"
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


SCHEMA_FILE = Path(__file__).with_name("spec.schema.json")
"""The committed JSON Schema (`moespec schema` writes it); shipped specs point editors at it."""


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a spec file, generated from the pydantic models. Editors use it to
    complete and check specs; checks that span fields (top_k <= experts, ...) are only in `load_spec`."""
    schema = Spec.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema, "title": "moespec spec"}


def json_schema_text() -> str:
    """`json_schema()` as the text of `spec.schema.json`."""
    import json

    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"

"""The spec: one frozen pydantic model per YAML mapping.

    name: vit-s16-moe8-every2-top2
    backbone: {model: vit_small_patch16_224, kwargs: {num_classes: 1000}}
    input_size: [3, 224, 224]
    moe:
      - where: {every: 2}
        experts: 8
        router: {kind: topk, top_k: 2}
    upcycle: {router_init: normal, noise: 0.0, split: slice}

The README's "Spec language" section documents every field; the models below are the single source of
truth for names, types and defaults. The `where:` and `router:` fields are unions over the registries of
`spec.registry`; `_rebuild` refreshes them whenever a selector or router kind is registered.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import (
    AfterValidator,
    BeforeValidator,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from .compat import DEFAULT_ROUTER_KIND, MOVED_TO_ROUTER, router_kind_of, upgrade_group
from .fields import FloatRange, IntRange, OneOrList, SpecModel
from .registry import ROUTER_KINDS, FieldError, RouterSpec, on_register
from .selectors import MAX_BLOCKS, where_type

DENSE_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".pth.tar")
"""The dense checkpoint files `backbone.checkpoint` may name."""

# Upper bounds of the spec's numbers: generous for every published configuration, small enough that the
# sizes built from them (experts x hidden x width) never overflow torch's 64-bit sizes.
MAX_EXPERTS = 65_536
"""Routed experts, top_k and shared experts of a layer: 16 x the largest published layer, Soft MoE's 4,096
experts (Puigcerver et al. 2024; V-MoE has 32, Riquelme et al. 2021)."""
MAX_EXPERT_HIDDEN = 1_048_576
"""An expert's hidden width (2**20): 40 x the widest published ViT MLP, ViT-22B's 24,576 (Dehghani et al. 2023)."""
MAX_WIDTH_FACTOR = 64.0
"""`expert_mlp_ratio` and rescale factors: 16 x ViT's MLP ratio of 4; Sparse-MLP rescales by 0.3 to 2."""
MAX_NOISE_STD = 100.0
"""Std of Gaussian noise (router logits, upcycled expert weights): 100 x the usual 1 / E of noisy top-k (Shazeer
et al. 2017) at one expert; N(0, 100^2) buries any logit or weight, and its draws stay finite even in float16."""
MAX_LOSS_WEIGHT = 100.0
"""An aux loss's weight: 10,000 x the usual 0.01 (Shazeer et al. 2017; Switch, Fedus et al. 2022), which already
buries the task loss; larger ones (summed over a group's losses) overflow a float16 loss."""
MAX_LOSS_SCALE = 2.0**24
"""`aux_loss_backward_scale`: gradient accumulation's 1/N is at most 1; 2**24 is 256 x a GradScaler's initial
scale of 2**16, and keeps a float32 loss times it finite."""
MAX_CHANNELS = 1_024
"""Input channels: 4 x hyperspectral images' 224 bands (AVIRIS)."""
MAX_IMAGE_SIDE = 16_384
"""Input height and width in pixels: 16 x the 1,024 px of SAM's ViT (Kirillov et al. 2023), the largest in timm."""


INT64 = (-(2**63), 2**63 - 1)
"""The integers torch takes (C++ int64_t): timm passes `backbone.kwargs` on to torch, where a larger one is an
overflow with a C++ frame dump. Sizes that fit but are too large to build are the memory guard's to refuse."""


def _fits_torch(value: Any) -> Any:
    """A `backbone.kwargs` value whose integers (also inside lists and mappings: `img_size: [h, w]`) fit int64
    and whose floats are finite: `drop_rate: .nan` reached timm, and the refusal that came back was blamed on
    another field."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack += item
        elif isinstance(item, dict):
            stack += item.values()
        elif isinstance(item, int) and not INT64[0] <= item <= INT64[1]:
            raise ValueError(f"{item} does not fit torch's 64-bit integers; timm's arguments are between -2**63 "
                             f"and 2**63 - 1")
        elif isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{item} is not a finite number; timm's arguments (rates, scales, sizes) are finite")
    return value


class Backbone(SpecModel):
    """The dense timm model the surgery starts from."""

    model: Annotated[str, Field(min_length=1)]
    """Any timm model name, e.g. `vit_small_patch16_224`."""
    kwargs: dict[str, Annotated[Any, AfterValidator(_fits_torch)]] = {}
    """Forwarded to `timm.create_model` (img_size, depth, embed_dim, num_classes, ...)."""
    checkpoint: Optional[str] = None
    """Local dense checkpoint (.safetensors/.pth/.bin) to upcycle from; relative paths are relative to the
    spec file."""
    pretrained: bool = False
    """Upcycle from timm's pretrained weights (needs a network)."""
    pre_logits: bool = False
    """ViT's representation layer (Dosovitskiy et al. 2021, `representation_size` = the width): a Linear and a tanh
    between the pooled token and the head, which V-MoE's checkpoints have and timm's ViT has no field for. It sits
    in timm's `fc_norm` place (after the norm there), so `forward_head(x, pre_logits=True)` returns its output."""

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

    @field_validator("kwargs")
    @classmethod
    def _addressable_depth(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A block count in kwargs (`depth`, `depths`, `layers`, `num_blocks`, ...) of at most `MAX_BLOCKS`:
        timm spends time on every block before it builds the first (ViT's drop-path rates: 12 s for `depth:
        1000000`), so this is checked here, before any build; `backbones.placement.module_budget` bounds the
        rest of a build."""
        for key, value in kwargs.items():
            counts = value if isinstance(value, (list, tuple)) else [value]
            if not BLOCK_COUNT_KEY.search(key) or not all(type(n) is int for n in counts):
                continue
            if sum(counts) > MAX_BLOCKS:
                raise FieldError(key, f"{sum(counts):,} blocks is more than the {MAX_BLOCKS:,} a spec can select "
                                      f"(timm builds every block, even for a plan); check {key}")
        return kwargs


BLOCK_COUNT_KEY = re.compile(r"depth|layers|blocks")
"""timm's names for a backbone's block counts, e.g. `depth` (ViT), `depths` (ConvNeXt, Swin), `layers` (ResNet),
`num_blocks` (MLP-Mixer); ones that name no count (`return_interm_layers`, `depth_mult`) hold no integers."""


def router_type() -> Any:
    """The type of a `router:` field over the router kinds registered now, chosen by `kind`."""
    members = tuple(Annotated[spec, Tag(name)] for name, spec in ROUTER_KINDS.items())
    return Annotated[Union[members], Discriminator(router_kind_of)]  # type: ignore[valid-type]


class AuxLoss(SpecModel):
    """A load-balancing loss of the layer's last forward, added by `moespec.aux_loss(model)`."""

    kind: Literal["importance_load", "switch", "z_loss"] = "importance_load"
    weight: FloatRange(0.0, MAX_LOSS_WEIGHT) = 0.01


class MoEGroup(SpecModel):
    """One surgery group: the FFN `sublayer` (default: every FFN) of each block picked by `where` becomes an MoE
    layer. How items
    reach the experts, and every setting of that (`top_k`, `capacity_factor`, ...), is the `router`'s."""

    model_config = {**SpecModel.model_config, "json_schema_extra": lambda schema: _moved_keys_schema(schema)}

    where: Any
    """Which blocks: one selector or a list of them (their union)."""
    sublayer: Optional[Annotated[str, Field(min_length=1)]] = None
    """Which FFN of each block, by its path in the block (`mlp`, `mlp_channels`, `attn_grid.mlp`); default: every
    FFN the block has (one in most models; a Mixer block's token and channel FFNs; MaxViT's two)."""
    experts: IntRange(0, MAX_EXPERTS)
    """Routed experts E. 0 means a plain (dense) MLP of width `expert_hidden`, only in blocks rebuilt by
    `rescale` (Sparse-MLP's "0 = plain MLP")."""
    expert_hidden: Optional[IntRange(1, MAX_EXPERT_HIDDEN)] = None
    """Hidden width of each expert; default: the dense FFN's hidden width."""
    expert_mlp_ratio: Optional[FloatRange(0.0, MAX_WIDTH_FACTOR, low_open=True)] = None
    """Hidden width as a multiple of the FFN's input width (alternative to `expert_hidden`)."""
    shared_experts: IntRange(0, MAX_EXPERTS) = 0
    """Always-active experts whose output is added to the routed output (ViMoE)."""
    router: Any = None
    aux_loss: OneOrList(AuxLoss) = [AuxLoss()]
    """One aux loss or a list of them; stored as a list."""

    @model_validator(mode="before")
    @classmethod
    def _previous_release(cls, data: Any) -> Any:
        """Release 0.1's `top_k` / `capacity_factor` on the group move into the router (`spec.compat`)."""
        return upgrade_group(data)

    @model_validator(mode="before")
    @classmethod
    def _no_default_aux_loss_without_balancing(cls, data: Any) -> Any:
        """A router without load balancing (Soft MoE, Puigcerver et al. 2024) has no default aux loss."""
        if isinstance(data, dict) and "aux_loss" not in data:
            spec = ROUTER_KINDS.get(router_kind_of(data.get("router") or {}))
            if spec is not None and not spec.load_balanced:
                data = {**data, "aux_loss": []}
        return data

    # Cross-field checks sit on the later of the two fields, so that errors name a field, not the group.
    @field_validator("router")
    @classmethod
    def _router_fits_experts(cls, router: RouterSpec, info: ValidationInfo) -> RouterSpec:
        experts = info.data.get("experts")
        if experts:
            router.check_experts(experts)
        return router

    @field_validator("aux_loss")
    @classmethod
    def _aux_loss_where_balanced(cls, losses: list[AuxLoss], info: ValidationInfo) -> list[AuxLoss]:
        router = info.data.get("router")
        if losses and router is not None and not router.load_balanced:
            raise ValueError(f"{router.title} has no load-balancing loss; remove aux_loss")
        return losses

    @field_validator("expert_mlp_ratio")
    @classmethod
    def _one_width(cls, ratio: float | None, info: ValidationInfo) -> float | None:
        if ratio is not None and info.data.get("expert_hidden") is not None:
            raise ValueError("give expert_hidden or expert_mlp_ratio, not both")
        return ratio


def _moved_keys_schema(schema: dict) -> None:
    """Release 0.1's group keys, in the JSON Schema as deprecated: an editor marks them, and moespec still
    reads them (`spec.compat`)."""
    for key in MOVED_TO_ROUTER:
        schema["properties"][key] = {"deprecated": True, "description": f"Moved to router.{key} (release 0.1 "
                                     f"wrote it here; `moespec validate --fix` moves it)."}


MAX_SOURCES = 1_024
"""Dense checkpoints one upcycle may take experts from: 16 x the experts of the largest published layer built from
fine-tuned models (mergekit-moe's clown cars have up to 64 sources)."""


class Upcycle(SpecModel):
    """How experts and routers start when dense models are upcycled: sparse upcycling (Komatsuzaki et al. 2023),
    experts from several checkpoints (mergekit-moe), routers started from data (mergekit's `gate_mode: hidden`,
    cluster-aware upcycling) and Drop-Upcycling (Nakamura et al. 2025)."""

    router_init: Literal["normal", "zeros", "hidden", "kmeans"] = "normal"
    """`normal`: N(0, 0.02^2); `zeros`: all gates equal at the start; `hidden`: expert i's row points along the mean
    router input of its source's images (mergekit's `hidden`; needs images per source); `kmeans`: the rows are
    k-means centroids of the router inputs of the images given (cluster-aware upcycling)."""
    noise: FloatRange(0.0, MAX_NOISE_STD) = 0.0
    """Std of Gaussian noise added to each expert's copied weights, relative to each tensor's std."""
    split: Literal["slice", "partition"] = "slice"
    """For experts narrower than the dense FFN: `slice` gives every expert the leading hidden units,
    `partition` gives expert i its own block of units."""
    drop: FloatRange(0.0, 1.0) = 0.0
    """Drop-Upcycling: the fraction r of each routed expert's hidden units re-initialized (a different random
    subset per expert) from N(mean, std^2) of the dense weights of those units; 0: plain copies."""
    experts_from: Optional[list[IntRange(0, MAX_SOURCES - 1)]] = None
    """The source checkpoint (0 = the first given) of each routed expert, one entry per expert of every MoE
    layer; default: expert i takes source i mod (number of sources)."""
    base: Literal["first", "average"] = "first"
    """Where everything outside the routed experts comes from (attention, norms, head, shared experts): the first
    source, or the average of all sources."""

    @field_validator("experts_from")
    @classmethod
    def _some_experts(cls, sources: list[int] | None) -> list[int] | None:
        if sources is not None and not sources:
            raise ValueError("give one source index per routed expert, or leave experts_from out")
        return sources


class RescaleSpec(SpecModel):
    """Sparse-MLP rescale (Lou et al. 2022): each selected block is rebuilt at [S1, C1] = [tokens * S, channels * C],
    wrapped by a pro-token rescale [S, C] -> [S1, C1] before it and a pro-channel rescale back after it."""

    where: Any
    tokens: FloatRange(0.0, MAX_WIDTH_FACTOR, low_open=True) = 1.0
    """S1 / S."""
    channels: FloatRange(0.0, MAX_WIDTH_FACTOR, low_open=True) = 1.0
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
    input_size: Optional[Annotated[tuple[IntRange(1, MAX_CHANNELS), IntRange(1, MAX_IMAGE_SIDE),
                                         IntRange(1, MAX_IMAGE_SIDE)],
                                   BeforeValidator(_channels_height_width)]] = None
    """(channels, height, width); default: the backbone's pretrained_cfg input_size."""
    rescale: OneOrList(RescaleSpec) = []
    """Blocks to rebuild at a rescaled shape (Sparse-MLP); one mapping or a list."""
    moe: list[MoEGroup] = []
    upcycle: Upcycle = Upcycle()
    aux_loss_in_backward: bool = False
    """Add every MoE layer's weighted aux loss to the gradients in backward (like Megatron's
    MoEAuxLossAutoScaler), for training loops that never call `moespec.aux_loss`; `moespec.aux_loss(model)`
    then returns the value detached, for logging, so adding it as well does not count it twice."""
    aux_loss_backward_scale: FloatRange(0.0, MAX_LOSS_SCALE, low_open=True) = 1.0
    """With aux_loss_in_backward: the factor the training loop multiplies its loss by before backward, so
    that the aux loss gets the same: 1/N for gradient accumulation over N micro-batches (timm's train.py
    --grad-accum-steps N). A GradScaler's changing scale is followed with `moespec.follow_grad_scaler`."""
    _source: Optional[str] = PrivateAttr(default=None)

    @field_validator("upcycle")
    @classmethod
    def _upcycle_fits_the_layers(cls, upcycle: Upcycle, info: ValidationInfo) -> Upcycle:
        """`experts_from` has an entry per routed expert of every MoE group; a router started from data has one
        gate row per expert to start."""
        groups = info.data.get("moe") or []
        if upcycle.experts_from is not None:
            wrong = [f"moe.{i}.experts is {g.experts}" for i, g in enumerate(groups)
                     if g.experts and g.experts != len(upcycle.experts_from)]
            if wrong:
                raise FieldError("experts_from", f"has {len(upcycle.experts_from)} entries, one per routed expert, "
                                                 f"but {', '.join(wrong)}")
        if upcycle.router_init in ("hidden", "kmeans"):
            rowless = [f"moe.{i} ({g.router.title})" for i, g in enumerate(groups)
                       if g.experts and not g.router.rows_per_expert]
            if rowless:
                raise FieldError("router_init", f"{upcycle.router_init} starts one gate row per expert, and "
                                                f"{', '.join(rowless)} has none; use normal or zeros")
        return upcycle

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


def _replace_field(model: type[SpecModel], name: str, annotation: Any, default: Any = ...) -> None:
    old = model.model_fields[name]
    new = FieldInfo.from_annotated_attribute(annotation, default)
    new.description = old.description
    model.model_fields[name] = new


def _rebuild() -> None:
    """Refresh the fields built from the registries, then the models that contain them, so that a selector
    or router kind registered after import is validated and appears in the JSON Schema."""
    if not ROUTER_KINDS:  # the built-in kinds register when `moespec.routers` is imported
        return
    where = where_type()
    _replace_field(MoEGroup, "where", where)
    _replace_field(RescaleSpec, "where", where)
    default_router = ROUTER_KINDS[DEFAULT_ROUTER_KIND]() if DEFAULT_ROUTER_KIND in ROUTER_KINDS else ...
    _replace_field(MoEGroup, "router", router_type(), default_router)
    for model in (MoEGroup, RescaleSpec, Spec):
        model.model_rebuild(force=True)


on_register(_rebuild)

"""Specs as timm models: `register_timm(spec, name)` makes `timm.create_model(name, ...)` build the spec.

    moespec.register_timm("specs/vit_s16_moe8_every2_top2.yaml", name="vit_s16_moe8")
    model = timm.create_model("vit_s16_moe8", num_classes=100, drop_path_rate=0.1)

timm's keyword arguments update the spec's `backbone.kwargs` (so they reach the timm backbone), and
`pretrained=True` upcycles the experts from the spec's dense source (`moespec.upcycle`: the spec's
`backbone.checkpoint`, else timm's pretrained weights). timm's training script knows nothing of aux losses,
so registered models send theirs into backward by default (`aux_loss_in_backward`, see `layers/moe.py`).
`features_only=True` (with `out_indices`) gives the feature backbone timm makes of the dense backbone, around
the MoE model (`hub.as_timm_model`); `device=` and `dtype=` place the MoE model as they place timm's.

The name is in timm's registry as timm's own names are: under the backbone's module (`list_models(module=
"vision_transformer")` lists a ViT's), with a pretrained cfg (`get_pretrained_cfg`, `list_models(name_matches_cfg=
True)`): the backbone's, at the spec's input size and head, naming the spec. It has weights
(`list_models(pretrained=True)`) only where the spec names its dense source. timm's errors come back as timm's
types (an unknown kwarg a TypeError), with moespec's message and as a `SpecError` too (`errors.raised_as_timm`).
The model's pretrained_cfg is the name's under moespec's architecture, so that timm's `save_for_hf` writes a
folder that `timm.create_model("local-dir:FOLDER")` builds again (`apps.hub`).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path
from typing import Any

import timm
import timm.models
from timm.models import _registry as timm_registry
from timm.models import generate_default_cfgs, get_pretrained_cfg, resolve_pretrained_cfg
from timm.models._pretrained import DefaultCfg, PretrainedCfg
from torch import nn

from ..compiler import create_model
from ..errors import MoespecError, SpecError, raised_as_timm
from ..planning import spec_input_size
from ..spec import HUB_ARCHITECTURE, Spec, load_spec
from ..weights import upcycle
from .hub import FEATURE_KWARGS, RUNTIME_KWARGS, as_timm_model, placed

REGISTERED: dict[str, Spec] = {}
"""timm model name -> the spec it builds (before timm's kwargs), for every name moespec registered."""

default_cfgs: dict[str, DefaultCfg] = {}
"""timm model name -> its pretrained cfg (`pretrained_cfg_of`): timm's `register_model` reads a module's
`default_cfgs`."""

TIMM_ONLY_KWARGS = ("pretrained_cfg", "pretrained_cfg_overlay", *RUNTIME_KWARGS)
"""What `timm.create_model` passes to every entry point that concerns timm's own weights, not the backbone."""


def register_timm(spec_or_path: Spec | str | Path, name: str | None = None, *,
                  aux_loss_in_backward: bool = True, aux_loss_backward_scale: float | None = None) -> str:
    """Register a spec (or spec file) as the timm model `name` (default: the spec's name with `_` for `-`).

    `aux_loss_in_backward` sets the spec's option of that name: the load-balancing loss reaches the gradients
    even when the training loop never calls `moespec.aux_loss`. `aux_loss_backward_scale` (default: the
    spec's, 1) is what the loop multiplies its loss by: 1/N for timm's train.py with --grad-accum-steps N.
    timm's train.py with float16 AMP scales its loss with a GradScaler that moespec cannot reach: train in
    bfloat16 (--amp-dtype bfloat16, no scaler) there, or call `moespec.follow_grad_scaler` in your own loop;
    moespec warns when it sees either mismatch. Registering a moespec name again replaces it; a name timm
    already has for its own models is refused. Returns the name.
    """
    spec = spec_or_path if isinstance(spec_or_path, Spec) else load_spec(spec_or_path)
    update: dict = {"aux_loss_in_backward": aux_loss_in_backward}
    if aux_loss_backward_scale is not None:
        if not aux_loss_backward_scale > 0:
            raise MoespecError(f"aux_loss_backward_scale must be > 0 (1/N for N accumulation steps), got "
                               f"{aux_loss_backward_scale!r}")
        update["aux_loss_backward_scale"] = float(aux_loss_backward_scale)
    spec = spec.model_copy(update=update)
    name = _checked_name(name if name is not None else (spec.name or "").replace("-", "_"))
    cfg = pretrained_cfg_of(spec)

    def entry(pretrained: bool = False, pretrained_cfg: dict | str | None = None,
              pretrained_cfg_overlay: dict | None = None, **kwargs: Any) -> nn.Module:
        resolved = resolve_pretrained_cfg(name, pretrained_cfg).to_dict()  # the name's, a tag's or the caller's
        resolved["architecture"] = HUB_ARCHITECTURE  # what save_for_hf writes: a folder any moespec builds
        features = {key: kwargs.pop(key) for key in FEATURE_KWARGS if key in kwargs}
        try:
            model = build(spec, pretrained=pretrained, **kwargs)
        except SpecError as error:
            raise raised_as_timm(error) from None
        return as_timm_model(model, name, resolved, pretrained_cfg_overlay, **features)

    entry.__name__ = entry.__qualname__ = name
    entry.__module__ = __name__
    entry.__doc__ = f"moespec spec {spec.name!r} ({spec.source or 'built in Python'}) as a timm model."
    setattr(sys.modules[__name__], name, entry)  # timm lists entry points as attributes of their module
    _forget(name)
    default_cfgs[name] = generate_default_cfgs({name: cfg})[name]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=f"Overwriting {name} in registry")  # our own earlier registration
        timm.models.register_model(entry)
    _file_under(name, timm_registry._model_to_module.get(timm.models.get_arch_name(spec.backbone.model)))
    REGISTERED[name] = spec
    return name


def build(spec: Spec, *, pretrained: bool = False, device: Any = None, dtype: Any = None, **kwargs: Any) -> nn.Module:
    """The model `timm.create_model` returns for a registered spec: timm's kwargs (None values dropped, as
    timm does) update `backbone.kwargs`; `pretrained` upcycles; built on `device` (upcycled on the CPU, then
    moved), in `dtype`; training mode, like any fresh timm model."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None and k not in TIMM_ONLY_KWARGS}
    backbone = spec.backbone.model_copy(update={"kwargs": {**spec.backbone.kwargs, **kwargs},
                                                "pretrained": spec.backbone.pretrained or pretrained})
    spec = spec.model_copy(update={"backbone": backbone})
    if pretrained:
        model = placed(upcycle(spec), device=device, dtype=dtype)
    else:
        model = placed(create_model(spec, device=device or "cpu"), dtype=dtype)
    return model.train()


def pretrained_cfg_of(spec: Spec) -> PretrainedCfg:
    """The pretrained cfg timm's registry holds for a registered spec: its backbone's (mean, std, crop,
    interpolation, first conv, classifier, license) at the spec's input size (`input_size`, else img_size /
    in_chans over the backbone's) and head (`num_classes`), describing the spec. Its weights are the dense source
    the spec names, the ones `pretrained=True` upcycles from: `backbone.checkpoint` (a file), or timm's weights
    with `backbone.pretrained: true`. A spec that names neither has none: the backbone's timm weights are a dense
    model's, and the name has no weights of its own."""
    backbone = spec.backbone
    dense = get_pretrained_cfg(backbone.model) or PretrainedCfg()
    size = tuple(spec_input_size(spec, tuple(dense.input_size)))
    source = f"the spec file {spec.source}" if spec.source else f"the spec {spec.name or '(unnamed)'} built in Python"
    changes: dict[str, Any] = {"architecture": None, "tag": None, "input_size": size,
                               "description": f"moespec: a Mixture-of-Experts {backbone.model} from {source}"}
    if size != tuple(dense.input_size):
        changes["test_input_size"] = None  # the dense weights' test size, not this model's
    classes = backbone.kwargs.get("num_classes")
    if isinstance(classes, int) and classes != dense.num_classes:
        changes.update(num_classes=classes, label_names=None, label_descriptions=None)
    if backbone.checkpoint or not (backbone.pretrained and dense.has_weights):
        changes.update(url=None, hf_hub_id=None, hf_hub_filename=None, state_dict=None, custom_load=False,
                       file=str(spec.resolve_path(backbone.checkpoint)) if backbone.checkpoint else None)
    return dataclasses.replace(dense, **changes)


def _forget(name: str) -> None:
    """Drop an earlier registration of `name` from the registry tables that an older timm's `register_model`
    leaves as they were (its weights, its module), so that the new one stands alone."""
    timm_registry._model_has_pretrained.discard(name)
    _unfile(name)


def _file_under(name: str, module: str | None) -> None:
    """List `name` under the backbone's timm module, as timm lists its own variants: `list_models(module=
    "vision_transformer")` finds a ViT's MoE. timm's `register_model` files a name under the module of its entry
    point (moespec's here), and no public call moves it: its two tables are updated as timm updates them."""
    if module is not None:
        _unfile(name)
        timm_registry._model_to_module[name] = module
        timm_registry._module_to_models[module].add(name)


def _unfile(name: str) -> None:
    module = timm_registry._model_to_module.pop(name, None)
    models = timm_registry._module_to_models.get(module) if module is not None else None
    if models is not None:
        models.discard(name)
        if not models:
            del timm_registry._module_to_models[module]  # as timm: no module listed without models


def _checked_name(name: str) -> str:
    if not name or not name.isidentifier():
        raise MoespecError(f"{name!r} cannot be a timm model name; use letters, digits and _ (timm reads '.' as a "
                           f"pretrained tag and ':' as a hub prefix)")
    if timm.is_model(name) and name not in REGISTERED:
        raise MoespecError(f"{name!r} is already a timm model; register the spec under another name")
    return name

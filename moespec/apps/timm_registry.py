"""Specs as timm models: `register_timm(spec, name)` makes `timm.create_model(name, ...)` build the spec.

    moespec.register_timm("specs/vit_s16_moe8_every2_top2.yaml", name="vit_s16_moe8")
    model = timm.create_model("vit_s16_moe8", num_classes=100, drop_path_rate=0.1)

timm's keyword arguments update the spec's `backbone.kwargs` (so they reach the timm backbone), and
`pretrained=True` upcycles the experts from the spec's dense source (`moespec.upcycle`: the spec's
`backbone.checkpoint`, else timm's pretrained weights). timm's training script knows nothing of aux losses,
so registered models send theirs into backward by default (`aux_loss_in_backward`, see `layers/moe.py`).
`features_only=True` (with `out_indices`) gives timm's feature backbone of the MoE model (`hub.as_timm_model`);
the model's pretrained_cfg is its dense backbone's, under moespec's architecture, so that timm's `save_for_hf`
writes a folder that `timm.create_model("local-dir:FOLDER")` builds again (`apps.hub`).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import timm
import timm.models
from torch import nn

from ..compiler import create_model
from ..errors import MoespecError
from ..spec import Spec, load_spec
from ..weights import upcycle
from .hub import FEATURE_KWARGS, RUNTIME_KWARGS, as_timm_model

REGISTERED: dict[str, Spec] = {}
"""timm model name -> the spec it builds (before timm's kwargs), for every name moespec registered."""

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
    def entry(pretrained: bool = False, pretrained_cfg: dict | None = None,
              pretrained_cfg_overlay: dict | None = None, **kwargs: Any) -> nn.Module:
        features = {key: kwargs.pop(key) for key in FEATURE_KWARGS if key in kwargs}
        model = build(spec, pretrained=pretrained, **kwargs)
        return as_timm_model(model, name, pretrained_cfg, pretrained_cfg_overlay, **features)

    entry.__name__ = entry.__qualname__ = name
    entry.__module__ = __name__
    entry.__doc__ = f"moespec spec {spec.name!r} ({spec.source or 'built in Python'}) as a timm model."
    setattr(sys.modules[__name__], name, entry)  # timm lists entry points as attributes of their module
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=f"Overwriting {name} in registry")  # our own earlier registration
        timm.models.register_model(entry)
    REGISTERED[name] = spec
    return name


def build(spec: Spec, *, pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """The model `timm.create_model` returns for a registered spec: timm's kwargs (None values dropped, as
    timm does) update `backbone.kwargs`; `pretrained` upcycles; training mode, like any fresh timm model."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None and k not in TIMM_ONLY_KWARGS}
    backbone = spec.backbone.model_copy(update={"kwargs": {**spec.backbone.kwargs, **kwargs},
                                                "pretrained": spec.backbone.pretrained or pretrained})
    spec = spec.model_copy(update={"backbone": backbone})
    model = upcycle(spec) if pretrained else create_model(spec)
    return model.train()


def _checked_name(name: str) -> str:
    if not name or not name.isidentifier():
        raise MoespecError(f"{name!r} cannot be a timm model name; use letters, digits and _ (timm reads '.' as a "
                           f"pretrained tag and ':' as a hub prefix)")
    if timm.is_model(name) and name not in REGISTERED:
        raise MoespecError(f"{name!r} is already a timm model; register the spec under another name")
    return name

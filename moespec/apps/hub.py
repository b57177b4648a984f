"""The MoE model of a Hugging Face Hub folder, as `timm.create_model("local-dir:FOLDER")` and
`("hf-hub:ORG/NAME")` build it, and what every timm entry point of moespec returns (`as_timm_model`).

timm reads the folder's config.json and calls moespec's entry point (`timm_hook`) with its `model_args`: the
spec (`spec.HUB_SPEC_ARG`) and the head and input size at save time, plus the caller's kwargs. With
`pretrained=True` the weights are the folder's own, read by timm's hub functions (the download is timm's) and
checked against the spec's model as every moespec checkpoint is (`check_state_dict`): a file of another model
is refused, never loaded in part. `num_classes` other than the saved one gives a new head after the load, as
timm's `load_pretrained` does for its models. As with `register_timm`, the aux loss reaches the gradients
without a call in the loop (`aux_loss_in_backward`): timm's loops never call `moespec.aux_loss`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from timm.models import _hub as timm_hub  # its hf_hub_download: the download is timm's, as for config.json
from timm.models import build_model_with_cfg
from timm.models._builder import _resolve_pretrained_source
from timm.models._hub import HF_WEIGHTS_NAME, _get_safe_alternatives, hf_split
from torch import nn

from ..compiler import create_model
from ..errors import CheckpointError, MoespecError
from ..spec import (
    HUB_ARCHITECTURE,
    HUB_CONFIG,
    HUB_SPEC_ARG,
    carried_spec,
    check_head,
    hub_config,
    model_args_spec,
)
from ..weights import check_buffers, check_state_dict, checked_weights, hub_weights, read_state_dict, weight_cap
from .timm_features import FEATURE_KWARGS, family_feature_args

RUNTIME_KWARGS = ("pretrained_model_args", "cache_dir")
"""What timm's factory passes every entry point besides the model's kwargs."""
PLACEMENT_KWARGS = ("device", "dtype")
"""timm's create_model kwargs for where and in which dtype the weights are made: the MoE model is built there
(`placed`), and the backbone never sees them (a device given to its meta build for the memory check mixed meta
and real tensors: EVA's "Cannot copy out of meta tensor")."""


def create_hub_model(pretrained: bool = False, pretrained_cfg: dict | None = None,
                     pretrained_cfg_overlay: dict | None = None, **kwargs: Any) -> nn.Module:
    """timm's entry point for `spec.HUB_ARCHITECTURE`: the model of the spec in `kwargs[HUB_SPEC_ARG]`."""
    carried = kwargs.pop(HUB_SPEC_ARG, None)
    origin = _origin(pretrained_cfg)
    saved = kwargs.pop("pretrained_model_args", None) or {}
    if HUB_SPEC_ARG in saved or (carried is None and origin != NO_FOLDER):  # a folder's config.json
        check_head(origin, _config_of(pretrained_cfg), model_args_spec(origin, saved or None))
    if not isinstance(carried, dict):
        raise MoespecError(f"{HUB_ARCHITECTURE} is the architecture of moespec models saved for the Hub; it is "
                           f"built from such a folder (timm.create_model('local-dir:FOLDER') or 'hf-hub:ORG/NAME'), "
                           f"whose config.json carries the spec in model_args.{HUB_SPEC_ARG}; {origin} has none")
    features = {key: kwargs.pop(key) for key in FEATURE_KWARGS if key in kwargs}
    placement = {key: kwargs.pop(key) for key in PLACEMENT_KWARGS if key in kwargs}
    cache_dir = kwargs.pop("cache_dir", None)
    classes = kwargs.get("num_classes")
    if pretrained and "num_classes" in saved:  # timm's own export: the saved head in model_args
        kwargs["num_classes"] = saved["num_classes"]  # `classes` replaces it after the load
    elif pretrained:  # moespec's writer: the carried spec sizes the saved head (`hub_folder.write_config`)
        kwargs.pop("num_classes", None)
    spec = carried_spec(origin, carried, kwargs)
    spec = spec.model_copy(update={"aux_loss_in_backward": True})  # as `register_timm`
    model = create_model(spec, device=placement.get("device") or "cpu")
    if pretrained:
        load_hub_weights(model, pretrained_cfg, origin, cache_dir)
        if classes is not None and classes != model.num_classes:
            model.reset_classifier(classes)
    model = placed(model, dtype=placement.get("dtype"))
    return as_timm_model(model, HUB_ARCHITECTURE, pretrained_cfg, pretrained_cfg_overlay, **features)


def _origin(pretrained_cfg: dict | None) -> str:
    """Where timm read the config from, for messages: 'FOLDER/config.json' or 'hf-hub:ORG/NAME'."""
    cfg = pretrained_cfg if isinstance(pretrained_cfg, dict) else {}
    if cfg.get("source") == "local-dir" and cfg.get("file"):
        return f"{cfg['file']}/{HUB_CONFIG}"
    if cfg.get("source") == "hf-hub" and cfg.get("hf_hub_id"):
        return f"hf-hub:{cfg['hf_hub_id']}"
    return NO_FOLDER


NO_FOLDER = "the given pretrained_cfg"


def _config_of(pretrained_cfg: dict | None) -> dict:
    """The config.json fields that `spec.check_head` checks: a local folder's own file (timm merged its root
    `num_classes` into `pretrained_cfg`, hiding which one was edited), else timm's pretrained_cfg."""
    cfg = pretrained_cfg if isinstance(pretrained_cfg, dict) else {}
    if cfg.get("source") == "local-dir" and cfg.get("file"):
        return hub_config(cfg["file"])
    return {"pretrained_cfg": cfg}


def load_hub_weights(model: nn.Module, pretrained_cfg: dict | None, origin: str, cache_dir=None) -> None:
    """Read the weights of the folder (or Hub repository) timm named in `pretrained_cfg` into `model`, checked
    name by name and shape by shape first: a checkpoint whose tensors do not match the spec's model is a
    CheckpointError, and nothing is loaded. moespec reads the file itself, as `moespec.load` does, not through
    timm's reader: an odd file (a fifo, a folder, a link out of the Hub cache, an empty file) is refused unopened
    (`weights.checked_weights`), and one whose tensors would take more than the model's can
    (`weights.weight_cap`: a zip bomb) before anything is inflated."""
    source, location = _resolve_pretrained_source(pretrained_cfg or {})
    if source == "local-dir":
        file = hub_weights(location)
    elif source == "hf-hub":
        file = _downloaded_weights(location, cache_dir, origin)
    else:
        raise MoespecError(f"{origin}: pretrained=True reads a moespec model's weights from its Hub folder "
                           f"(timm.create_model('local-dir:FOLDER' or 'hf-hub:ORG/NAME', pretrained=True)); "
                           f"this pretrained_cfg names none")
    state = read_state_dict(file, max_bytes=weight_cap(model))
    check_state_dict(state, model, origin)
    model.load_state_dict(state)
    check_buffers(model.named_buffers(), origin)


def _downloaded_weights(location: str | tuple[str, str], cache_dir, origin: str) -> Path:
    """The weights file of a Hub repository in Hugging Face's cache (downloaded there if need be), found as
    timm's `load_state_dict_from_hf` finds it: the safetensors alternative of the named file first (of the default,
    pytorch_model.bin: model.safetensors), then the file; checked as a local folder's is (`checked_weights`). A
    file name from the config that is not a plain name (a path) is refused, never asked for."""
    model_id, filename = location if isinstance(location, tuple) else (location, HF_WEIGHTS_NAME)
    if not isinstance(filename, str) or Path(filename).name != filename or filename in ("", ".", ".."):
        raise CheckpointError(f"{origin}: pretrained_cfg.hf_hub_filename: {str(filename)[:80]!r} is not a file name; "
                              f"a Hub repository's weights file is named plainly (model.safetensors)")
    repo, revision = hf_split(model_id)
    names = [*_get_safe_alternatives(filename), filename]
    for name in names:
        try:
            found = timm_hub.hf_hub_download(repo_id=repo, filename=name, revision=revision, cache_dir=cache_dir)
        except timm_hub.EntryNotFoundError:
            if name == names[-1]:
                raise CheckpointError(f"hf-hub:{model_id}: has no weights ({' or '.join(names)})") from None
            continue
        return checked_weights(Path(found))
    raise AssertionError("unreachable: names is never empty")


def placed(model: nn.Module, *, device: Any = None, dtype: Any = None) -> nn.Module:
    """`model` moved to `device` and cast to `dtype` where given (timm's create_model kwargs of those names)."""
    return model.to(device=device, dtype=dtype) if device is not None or dtype is not None else model


def as_timm_model(model: nn.Module, architecture: str, pretrained_cfg: dict | None = None,
                  pretrained_cfg_overlay: dict | None = None, **features: Any) -> nn.Module:
    """`model` as timm's `build_model_with_cfg` returns a model: its pretrained_cfg (`pretrained_cfg` where
    timm gave one, a Hub folder's or a registered name's, else the model's own: the dense backbone's with
    moespec's architecture) with `pretrained_cfg_overlay` over it, and with `features_only=True` (`out_indices`,
    `feature_cls`) the feature backbone timm makes of the dense backbone: the same wrapper with the same
    arguments (`timm_features`; a `FeatureListNet` for ConvNeXt, a `FeatureGetterNet` for ViT). The MoE layers
    stay inside, so `moespec.aux_loss` of the wrapper is the layers' loss."""
    cfg = dict(pretrained_cfg) if isinstance(pretrained_cfg, dict) else dict(getattr(model, "pretrained_cfg", {}))
    feature_cfg: dict[str, Any] = {}
    if features.get("features_only"):
        feature_cfg, features = _feature_args(model, features)
    traits = getattr(model, "_traits", None)
    built = build_model_with_cfg(lambda **_: model, architecture, pretrained=False, pretrained_cfg=cfg,
                                 pretrained_cfg_overlay=pretrained_cfg_overlay, feature_cfg=feature_cfg, **features)
    if traits is not None:
        model._traits = traits  # the backbone's, as timm set them at its build
    return built


def _feature_args(model: nn.Module, features: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`feature_cfg` and the feature kwargs for `build_model_with_cfg`: those the backbone's family gives its dense
    model (`family_feature_args`); for a family that wraps nothing so, timm's `FeatureGetterNet` over
    `forward_intermediates` where the model has it, else timm's default wrapper."""
    spec = getattr(model, "moespec_spec", None)
    found = family_feature_args(spec.backbone.model, spec.backbone.kwargs, features) if spec is not None else None
    if found is not None:
        return found.feature_cfg, found.kwargs
    if hasattr(model, "forward_intermediates"):
        return {"feature_cls": "getter", "out_indices": min(4, len(getattr(model, "feature_info", [])))}, features
    return {"flatten_sequential": True}, features

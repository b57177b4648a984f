"""The feature backbone a timm family makes with `features_only=True`, asked of the family itself, so that the MoE
model of its backbone gets the same one.

Each timm family tells `build_model_with_cfg` how to wrap its model (`feature_cfg`): ConvNeXt a `FeatureListNet`
over its stages (`flatten_sequential`, out_indices 0-3), ViT and EVA a `FeatureGetterNet` over
`forward_intermediates` (the last 3 blocks unless told), Swin indices from its `depths`, others timm's default
list. Rather than copy each family's choice (and miss the next one's), `family_feature_args` calls the backbone's
own entry point with the caller's feature kwargs and the spec's kwargs, and stops it where it calls
`build_model_with_cfg`, before anything is built: what that call was given is what the MoE model is wrapped with
(`hub.as_timm_model`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import timm.models
import torch
from timm.models import _builder

FEATURE_KWARGS = ("features_only", "out_indices", "feature_cls")
"""timm's create_model kwargs for a feature backbone: taken by `build_model_with_cfg`, never by the model."""


@dataclass(frozen=True)
class FeatureArgs:
    """What a family's entry point gave `build_model_with_cfg` for a feature backbone: its `feature_cfg`, and the
    feature kwargs (`FEATURE_KWARGS`) it passed on (an entry point may move `out_indices` into `feature_cfg`)."""

    feature_cfg: dict[str, Any] = field(default_factory=dict)
    kwargs: dict[str, Any] = field(default_factory=dict)


class _Stopped(Exception):
    """Raised in place of `build_model_with_cfg`: the entry point has said all it had to, nothing is built."""

    def __init__(self, found: FeatureArgs):
        super().__init__("stopped at build_model_with_cfg")
        self.found = found


_lock = threading.Lock()


def family_feature_args(model_name: str, model_kwargs: dict[str, Any],
                        features: dict[str, Any]) -> FeatureArgs | None:
    """The feature arguments timm's entry point of `model_name` gives `build_model_with_cfg` for
    `features_only=True` with `features` (out_indices, feature_cls) and the backbone's `model_kwargs`. None when it
    wraps nothing so: a family with a features class of its own (EfficientNet's), or an entry point outside
    timm's builder. An entry point that refuses the features (an out_indices its family cannot give) raises its
    own error, as it does for the dense model. An entry point that hard-codes one of `model_kwargs` (timm's "got
    multiple values") is asked again with the feature kwargs alone."""
    entry = timm.models.model_entrypoint(model_name)
    for kwargs in ({**model_kwargs, **features}, dict(features)):
        try:
            with _builder_stopped(entry), torch.device("meta"):  # meta: an entry point outside the builder
                entry(pretrained=False, **kwargs)                 # allocates nothing
        except _Stopped as stop:
            found = stop.found
            return found if found.kwargs.get("features_only") else None
        except TypeError as error:
            if "multiple values" in str(error) and kwargs != features:
                continue
            raise
        return None
    return None


def _record(*_: Any, feature_cfg: dict | None = None, **kwargs: Any) -> None:
    raise _Stopped(FeatureArgs(dict(feature_cfg or {}), {k: kwargs[k] for k in FEATURE_KWARGS if k in kwargs}))


@contextlib.contextmanager
def _builder_stopped(entry: Callable[..., Any]) -> Iterator[None]:
    """While it lasts, `build_model_with_cfg` raises `_Stopped` in every module that calls it by that name: timm's
    families (one may call another's helper: ViT-hybrid builds through vision_transformer) and the entry point's
    own. Module globals, as `backbones.create._override_builder_kwargs` patches: no other thread may build a
    timm model meanwhile."""
    original = _builder.build_model_with_cfg
    names = [name for name in list(sys.modules) if name == "timm" or name.startswith("timm.")]
    modules = [sys.modules[name] for name in [*names, entry.__module__] if name in sys.modules]
    with _lock:
        patched = [module for module in modules if vars(module).get("build_model_with_cfg") is original]
        for module in patched:
            module.build_model_with_cfg = _record
        try:
            yield
        finally:
            for module in patched:
                module.build_model_with_cfg = original

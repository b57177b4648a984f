"""A Hub folder's config.json, read field by field: every refusal names the file, the field, what was found and
the fix, and none contradicts another (a moespec architecture is never "not a moespec model").

    hub_config(folder)             the config.json, as a plain file of bounded size and nesting
    check_architecture(file, cfg)  `architecture`: this moespec's, another release's, timm's, or broken
    model_args_spec(file, args)    the spec carried in `model_args.moespec`, with the other model_args over it
    carried_spec(file, c, kwargs)  that spec with other kwargs (timm's create_model's) over it
    check_head(file, cfg, spec)    `num_classes`, `label_names` and `pretrained_cfg` agree with the spec's head
    hub_spec(folder)               all of the above: the spec of the model the folder holds

The fields are those timm's `save_for_hf` writes and moespec's writer fills (`apps.hub_folder.write_config`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .._version import __version__
from ..errors import CheckpointError, SpecError
from ..files import RefusedFile, hub_target, load_json, read_regular
from .embedded import (
    HUB_ARCHITECTURE,
    HUB_SPEC_ARG,
    SPEC_HASH_KEY,
    SPEC_KEY,
    VERSION_KEY,
    embedded_spec,
    newer_writer,
    spec_with_model_args,
)
from .loading import HUB_CONFIG, is_hub_folder, load_spec
from .models import Spec

MAX_CONFIG_BYTES = 10_000_000  # a config.json with ImageNet-21k label names is under 1 MB
RESAVE = "save the model again with moespec.save_for_hf (or moespec compile / upcycle --hub)"
_LAYOUT = re.compile(r"moespec_v(\d+)_")
_OURS = int(_LAYOUT.match(HUB_ARCHITECTURE).group(1))
SPEC_FIELD = f"model_args.{HUB_SPEC_ARG}"


def _shown(value: Any) -> str:
    """`value` in a message: its JSON type and, for a scalar, itself (cut short)."""
    kinds = {dict: "a JSON object", list: "a list", str: "a string", bool: "true/false", int: "a number",
             float: "a number", type(None): "null"}
    kind = kinds.get(type(value), type(value).__name__)
    return kind if isinstance(value, (dict, list)) else f"{kind}, {str(value)[:80]!r}"


def hub_config(folder: str | Path) -> dict[str, Any]:
    """The config.json of a Hub folder, read as a plain file of bounded size and nesting; in a snapshot of
    Hugging Face's cache, through its link into the repository's own blobs (`files.hub_target`)."""
    file = Path(folder) / HUB_CONFIG
    try:
        config = load_json(read_regular(hub_target(file), MAX_CONFIG_BYTES))
    except RefusedFile as refused:
        raise CheckpointError(f"{file}: {refused}") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{file}: not valid JSON ({str(error)[:120]})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: {_shown(config)}, not a timm config (a JSON object with 'architecture')")
    return config


def check_architecture(file: Path, config: dict[str, Any]) -> None:
    """`config["architecture"]` is this moespec's (`HUB_ARCHITECTURE`), else a CheckpointError that says whose it
    is: missing or not a name (a broken file), another moespec release's layout (upgrade, or re-save with the
    release that reads it), or a timm model's (load it with timm)."""
    architecture = config.get("architecture")
    if architecture == HUB_ARCHITECTURE:
        return
    if "architecture" not in config:
        raise CheckpointError(f"{file}: architecture: missing; a Hub folder's config.json names its model's "
                              f"architecture (a moespec model's is {HUB_ARCHITECTURE!r}), so this one was cut or "
                              f"edited: {RESAVE}")
    if not isinstance(architecture, str):
        raise CheckpointError(f"{file}: architecture: {_shown(architecture)}, not a model name (a moespec model's "
                              f"is {HUB_ARCHITECTURE!r}); the file was edited: {RESAVE}")
    layout = _LAYOUT.match(architecture)
    written = _written_by(config)
    if layout and written == __version__:
        raise CheckpointError(f"{file}: architecture: {architecture[:80]!r}, but the moespec that wrote the file "
                              f"({written}, this one) names its layout {HUB_ARCHITECTURE!r}; the file was edited: "
                              f"set it back, or {RESAVE}")
    if layout and int(layout.group(1)) > _OURS:
        raise CheckpointError(f"{file}: architecture: {architecture[:80]!r} is moespec's Hub layout "
                              f"v{layout.group(1)}, written by moespec {written}; this moespec ({__version__}) reads "
                              f"layout v{_OURS} ({HUB_ARCHITECTURE!r}): upgrade moespec (pip install -U moespec)")
    if layout:
        raise CheckpointError(f"{file}: architecture: {architecture[:80]!r} is moespec's older Hub layout "
                              f"v{layout.group(1)}, written by moespec {written}; this moespec ({__version__}) reads "
                              f"layout v{_OURS} ({HUB_ARCHITECTURE!r}): load it with the moespec that wrote it and "
                              f"save it again with this one")
    if architecture.startswith("moespec"):
        raise CheckpointError(f"{file}: architecture: {architecture[:80]!r} names no moespec Hub layout (this "
                              f"moespec's is {HUB_ARCHITECTURE!r}); the file was edited: set it back, or {RESAVE}")
    raise CheckpointError(f"{file}: architecture: {architecture[:80]!r}, a timm model, not a moespec one (whose "
                          f"architecture is {HUB_ARCHITECTURE!r}); load it with timm.create_model"
                          f"('local-dir:{file.parent}', pretrained=True)")


def _written_by(config: dict[str, Any]) -> str:
    """The moespec version that wrote `config`, in words, from its model_args (none where they are broken)."""
    carried = config.get("model_args", {}).get(HUB_SPEC_ARG) if isinstance(config.get("model_args"), dict) else None
    version = carried.get(VERSION_KEY) if isinstance(carried, dict) else None
    return str(version)[:32] if isinstance(version, str) else "(version not recorded)"


def model_args_spec(file: str | Path, args: Any) -> Spec:
    """The spec that `args` (a config.json's `model_args`) carries under `HUB_SPEC_ARG`, checked against its hash,
    with the other model_args (the head and input size timm recorded at save time) in `backbone.kwargs`, as timm
    passes them to the entry point (`spec_with_model_args`). Anything missing or of the wrong type is a
    CheckpointError naming the field; a spec that does not validate is a SpecError located in it."""
    if args is None:
        raise CheckpointError(f"{file}: model_args: missing; moespec's architecture carries the spec in "
                              f"{SPEC_FIELD}, so the file was cut or edited: {RESAVE}")
    if not isinstance(args, dict):
        raise CheckpointError(f"{file}: model_args: {_shown(args)}, not a JSON object (the model's arguments, "
                              f"the spec in {SPEC_FIELD}); the file was edited: {RESAVE}")
    carried = args.get(HUB_SPEC_ARG)
    if not isinstance(carried, dict):
        found = "missing" if carried is None else f"{_shown(carried)}, not a JSON object"
        raise CheckpointError(f"{file}: {SPEC_FIELD}: {found}; it holds the spec moespec builds the model from "
                              f"({SPEC_KEY!r}, {SPEC_HASH_KEY!r}, {VERSION_KEY!r}): {RESAVE}")
    spec_yaml = carried.get(SPEC_KEY)
    if not isinstance(spec_yaml, str):
        found = "missing" if spec_yaml is None else f"{_shown(spec_yaml)}, not the spec's YAML text"
        raise CheckpointError(f"{file}: {SPEC_FIELD}[{SPEC_KEY!r}]: {found}; the file was cut or edited: {RESAVE}")
    digest = carried.get(SPEC_HASH_KEY)
    if not isinstance(digest, str):
        found = "missing" if SPEC_HASH_KEY not in carried else f"{_shown(digest)}, not the spec's sha256"
        raise CheckpointError(f"{file}: {SPEC_FIELD}[{SPEC_HASH_KEY!r}]: {found}; the file was cut or edited: "
                              f"{RESAVE}")
    return carried_spec(file, carried, {k: v for k, v in args.items() if k != HUB_SPEC_ARG})


def carried_spec(file: str | Path, carried: dict[str, Any], kwargs: dict[str, Any]) -> Spec:
    """The spec in `carried` (a config.json's `model_args.moespec`), checked against its hash, with `kwargs` (the
    other model_args, or timm's create_model kwargs) over its `backbone.kwargs`; its problems are located in
    `FILE[model_args.moespec]`. One that does not validate, written by a newer moespec, says to upgrade."""
    try:
        spec = embedded_spec(f"{file}: {SPEC_FIELD}", carried, label=f"{file}[{SPEC_FIELD}]")
        return spec_with_model_args(spec, kwargs)
    except CheckpointError as error:
        if "does not match its hash" in str(error):
            raise CheckpointError(f"{file}: {SPEC_FIELD}[{SPEC_HASH_KEY!r}]: does not match the spec's YAML in "
                                  f"{SPEC_FIELD}[{SPEC_KEY!r}]; the spec was edited after it was saved: to change "
                                  f"the model, edit a spec file and build it (moespec compile / upcycle --hub); "
                                  f"else {RESAVE}") from None
        raise
    except SpecError as error:
        raise newer_writer(f"{file}: {SPEC_FIELD}", carried.get(VERSION_KEY), error) or error from None


def check_head(file: str | Path, config: dict[str, Any], spec: Spec) -> None:
    """The config's record of the head (`num_classes`, `label_names`, at its root or in `pretrained_cfg`) agrees
    with the head the spec makes, and `pretrained_cfg` is a JSON object; else a CheckpointError naming the field.
    timm reads these for the class names and the head it reports, so a clash gives a model whose labels lie."""
    cfg = config.get("pretrained_cfg", {})
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{file}: pretrained_cfg: {_shown(cfg)}, not a JSON object (the input size, mean, "
                              f"std, classifier); the file was edited: {RESAVE}")
    classes = spec.backbone.kwargs.get("num_classes")
    for field, holder in (("num_classes", config), ("pretrained_cfg.num_classes", cfg)):
        value = holder.get("num_classes")
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(f"{file}: {field}: {_shown(value)}, not a number of classes (0 or more); the "
                                  f"file was edited: set it to the head's size{_head(classes)}, or {RESAVE}")
        if isinstance(classes, int) and value != classes:
            raise CheckpointError(f"{file}: {field}: {value}, but the spec in {SPEC_FIELD} makes a head of "
                                  f"{classes} classes; the file was edited: set {field} to {classes}, or, for a new "
                                  f"head, timm.create_model(..., pretrained=True, num_classes={value})")
    for field, holder in (("label_names", config), ("pretrained_cfg.label_names", cfg)):
        names = holder.get("label_names")
        if names is None:
            continue
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise CheckpointError(f"{file}: {field}: {_shown(names)}, not a list of class names (strings); the file "
                                  f"was edited: {RESAVE} (model_config={{'label_names': [...]}})")
        if isinstance(classes, int) and len(names) != classes:
            raise CheckpointError(f"{file}: {field}: {len(names)} names, but the spec in {SPEC_FIELD} makes a head "
                                  f"of {classes} classes; give one name per class: {RESAVE} "
                                  f"(model_config={{'label_names': [...]}})")


def _head(classes: Any) -> str:
    return f", {classes}" if isinstance(classes, int) else ""


def hub_spec(folder: str | Path) -> Spec:
    """The spec of the model a Hub folder holds (`model_args_spec`), once its architecture is this moespec's
    (`check_architecture`) and its head fields agree (`check_head`). A folder of another model is a
    CheckpointError that says whose it is and how to load it."""
    config = hub_config(folder)
    file = Path(folder) / HUB_CONFIG
    check_architecture(file, config)
    spec = model_args_spec(file, config.get("model_args"))
    check_head(file, config, spec)
    return spec


def load_model_spec(path: str | Path) -> Spec:
    """The spec of a spec file, or of a Hub folder of a moespec model (`hub_spec`): what `moespec stats` and
    `moespec plan` read."""
    return hub_spec(path) if is_hub_folder(path) else load_spec(path)

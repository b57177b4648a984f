"""A spec carried inside a saved model: in a checkpoint's header metadata, or in a Hugging Face Hub folder.

    spec_metadata(spec)          {moespec.spec: YAML, moespec.spec_sha256, moespec.version}
    embedded_spec(where, data)   that mapping back to a Spec, checked against its hash
    hub_spec(folder)             the spec of a Hub folder (timm's `save_for_hf` layout), from its config.json

A Hub folder is what `timm.models.save_for_hf` writes: `config.json` (`architecture`, `model_args`,
`pretrained_cfg`) beside `model.safetensors`. timm builds `local-dir:FOLDER` and `hf-hub:ORG/NAME` by calling the
entry point named by `architecture` with `model_args` as keyword arguments. A moespec model's architecture is
`HUB_ARCHITECTURE`, a name timm knows only once moespec is imported (`apps.timm_hook`), so that timm never
builds the dense backbone in its place; its spec rides in `model_args` under `HUB_SPEC_ARG`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from .._version import __version__
from ..errors import CheckpointError, MoespecError, SpecError
from ..files import RefusedFile, hub_target, load_json, read_regular
from .loading import HUB_CONFIG, is_hub_folder, load_spec
from .models import Spec

SPEC_KEY, SPEC_HASH_KEY, VERSION_KEY = "moespec.spec", "moespec.spec_sha256", "moespec.version"
HUB_ARCHITECTURE = "moespec_v1_pip_install_and_import_moespec"
"""The `architecture` of a moespec model's config.json. timm says `Unknown model (moespec_v1_pip_install_and_
import_moespec)` where moespec is not imported, or is too old to know this layout (a new layout gets a new
name), instead of building another model. Stays a valid timm name: no '.', no ':'."""
HUB_SPEC_ARG = "moespec"
"""The `model_args` entry (so the entry point's keyword argument) that carries the spec: `spec_metadata`."""
MAX_CONFIG_BYTES = 10_000_000  # a config.json with ImageNet-21k label names is under 1 MB


def spec_metadata(spec: Spec) -> dict[str, str]:
    """The spec YAML, its sha256 and the moespec version: a checkpoint's header metadata, and `HUB_SPEC_ARG`."""
    spec_yaml = spec.to_yaml()
    digest = hashlib.sha256(spec_yaml.encode()).hexdigest()
    return {SPEC_KEY: spec_yaml, SPEC_HASH_KEY: digest, VERSION_KEY: __version__}


def embedded_spec(where: str | Path, metadata: dict[str, str]) -> Spec:
    """The spec in `metadata` (checked against its hash). One that does not validate, written by a newer moespec,
    says to upgrade moespec."""
    spec_yaml = metadata.get(SPEC_KEY)
    if not isinstance(spec_yaml, str):
        raise CheckpointError(f"{where}: has no moespec spec in its metadata; is it a dense checkpoint? "
                              f"(upcycle it with `moespec upcycle SPEC --checkpoint {where}`)")
    if hashlib.sha256(spec_yaml.encode()).hexdigest() != metadata.get(SPEC_HASH_KEY):
        raise CheckpointError(f"{where}: the embedded spec does not match its hash; the file was altered")
    try:
        return load_spec(f"{where}[spec]", text=spec_yaml)
    except SpecError as error:
        written = metadata.get(VERSION_KEY)
        if isinstance(written, str) and _release(written) > _release(__version__):
            raise MoespecError(f"{where}: written by moespec {written[:32]}, newer than this moespec {__version__}, "
                               f"and its spec does not validate here ({error.problems[0]}); upgrade moespec: "
                               f"pip install -U moespec") from None
        raise


def _release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version ("0.2.1rc1" -> (0, 2, 1))."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


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
        raise CheckpointError(f"{file}: not a timm config (a JSON object with 'architecture')")
    return config


def hub_spec(folder: str | Path) -> Spec:
    """The spec of the model a Hub folder holds: the spec in its config.json's `model_args` with the other
    model_args (the head and input size timm recorded at save time) in `backbone.kwargs`, as timm passes them
    to the entry point (`spec_with_model_args`). A folder of another model is a CheckpointError."""
    config = hub_config(folder)
    file = Path(folder) / HUB_CONFIG
    args = config.get("model_args")
    if config.get("architecture") != HUB_ARCHITECTURE or not isinstance(args, dict) \
            or not isinstance(args.get(HUB_SPEC_ARG), dict):
        raise CheckpointError(f"{file}: not a moespec model (its architecture is "
                              f"{str(config.get('architecture'))[:80]!r}); load it with timm.create_model"
                              f"('local-dir:{folder}')")
    return spec_with_model_args(embedded_spec(file, args[HUB_SPEC_ARG]),
                                {k: v for k, v in args.items() if k != HUB_SPEC_ARG})


def spec_with_model_args(spec: Spec, args: dict[str, Any]) -> Spec:
    """`spec` with `args` (timm's model_args or create_model kwargs) over its `backbone.kwargs`, and without its
    dense source (`backbone.checkpoint`, `backbone.pretrained`): a saved model's weights are its own, and a path
    read from a file is never opened."""
    document = spec.model_dump(mode="json")
    document["backbone"].update(kwargs={**document["backbone"]["kwargs"], **args}, checkpoint=None, pretrained=False)
    try:
        changed = load_spec(document)
    except SpecError as error:
        raise SpecError([replace(p, file=spec.source) for p in error.problems]) from None
    changed._source = spec.source
    return changed


def load_model_spec(path: str | Path) -> Spec:
    """The spec of a spec file, or of a Hub folder of a moespec model (`hub_spec`): what `moespec stats` and
    `moespec plan` read."""
    return hub_spec(path) if is_hub_folder(path) else load_spec(path)

"""A spec carried inside a saved model: in a checkpoint's header metadata, or in a Hugging Face Hub folder.

    spec_metadata(spec)          {moespec.spec: YAML, moespec.spec_sha256, moespec.version}
    embedded_spec(where, data)   that mapping back to a Spec, checked against its hash
    spec_with_model_args(s, a)   a spec with timm's model_args (or kwargs) over its backbone.kwargs

A Hub folder is what `timm.models.save_for_hf` writes: `config.json` (`architecture`, `model_args`,
`pretrained_cfg`) beside `model.safetensors`. timm builds `local-dir:FOLDER` and `hf-hub:ORG/NAME` by calling the
entry point named by `architecture` with `model_args` as keyword arguments. A moespec model's architecture is
`HUB_ARCHITECTURE`, a name timm knows only once moespec is imported (`apps.timm_hook`), so that timm never
builds the dense backbone in its place; its spec rides in `model_args` under `HUB_SPEC_ARG`. `hub_config` reads
the config.json.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from .._version import __version__
from ..errors import CheckpointError, MoespecError, SpecError
from .loading import load_spec
from .models import Spec

SPEC_KEY, SPEC_HASH_KEY, VERSION_KEY = "moespec.spec", "moespec.spec_sha256", "moespec.version"
HUB_ARCHITECTURE = "moespec_v1_pip_install_and_import_moespec"
"""The `architecture` of a moespec model's config.json. timm says `Unknown model (moespec_v1_pip_install_and_
import_moespec)` where moespec is not imported, or is too old to know this layout (a new layout gets a new
name), instead of building another model. Stays a valid timm name: no '.', no ':'."""
HUB_SPEC_ARG = "moespec"
"""The `model_args` entry (so the entry point's keyword argument) that carries the spec: `spec_metadata`."""


def spec_metadata(spec: Spec) -> dict[str, str]:
    """The spec YAML, its sha256 and the moespec version: a checkpoint's header metadata, and `HUB_SPEC_ARG`."""
    spec_yaml = spec.to_yaml()
    digest = hashlib.sha256(spec_yaml.encode()).hexdigest()
    return {SPEC_KEY: spec_yaml, SPEC_HASH_KEY: digest, VERSION_KEY: __version__}


def embedded_spec(where: str | Path, metadata: dict[str, str], *, label: str | None = None) -> Spec:
    """The spec in `metadata` (checked against its hash). One that does not validate, written by a newer moespec,
    says to upgrade moespec. `label`: where its problems are located (default: `where[spec]`)."""
    spec_yaml = metadata.get(SPEC_KEY)
    if not isinstance(spec_yaml, str):
        raise CheckpointError(f"{where}: has no moespec spec in its metadata; is it a dense checkpoint? "
                              f"(upcycle it with `moespec upcycle SPEC --checkpoint {where}`)")
    if hashlib.sha256(spec_yaml.encode()).hexdigest() != metadata.get(SPEC_HASH_KEY):
        raise CheckpointError(f"{where}: the embedded spec does not match its hash; the file was altered")
    try:
        return load_spec(label or f"{where}[spec]", text=spec_yaml)
    except SpecError as error:
        raise newer_writer(where, metadata.get(VERSION_KEY), error) or error from None


def newer_writer(where: str, written: Any, error: SpecError) -> MoespecError | None:
    """The error for a spec that does not validate because a newer moespec (`written`, the version it records)
    wrote it: upgrade. None when it was not written by a newer moespec."""
    if isinstance(written, str) and _release(written) > _release(__version__):
        return MoespecError(f"{where}: written by moespec {written[:32]}, newer than this moespec {__version__}, "
                            f"and its spec does not validate here ({error.problems[0]}); upgrade moespec: "
                            f"pip install -U moespec")
    return None


def _release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version ("0.2.1rc1" -> (0, 2, 1))."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


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

"""Which folder a Hub write may replace: only a Hub folder moespec wrote (torch-free, so that the CLI checks
`-o` before any work).

A moespec Hub folder holds `config.json`, `model.safetensors` and `README.md` (and `.gitattributes`, where it
was downloaded with huggingface_hub); its marker is its config.json, which names moespec's architecture
(`spec.HUB_ARCHITECTURE`). `--force` replaces such a folder whole. Any other folder that holds files (a
project folder, the working directory: a spec, a checkpoint, notes) is refused, with `--force` too: replacing
it would delete them.
"""

from __future__ import annotations

from pathlib import Path

from ..files import RefusedFile, load_json, read_regular
from ..io import check_output
from ..spec import HUB_ARCHITECTURE

HUB_FILES = frozenset({"config.json", "model.safetensors", "README.md", ".gitattributes"})
MAX_CONFIG_BYTES = 2**20  # a config.json: the spec and a pretrained cfg


def check_hub_output(folder: str | Path, force: bool) -> Path:
    """`check_output` of a Hub folder: also refused, whatever `force`, where the folder is not one moespec
    wrote (`not_a_hub_folder`)."""
    return check_output(folder, force, folder=True, ours=not_a_hub_folder)


def not_a_hub_folder(folder: Path) -> str | None:
    """None where `folder` (not empty) is a Hub folder moespec wrote; else why it is not, in words."""
    entries = sorted(entry.name for entry in folder.iterdir())
    others = [name for name in entries if name not in HUB_FILES]
    if others:
        shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        return f"it holds files a moespec Hub folder does not ({shown})"
    try:
        config = load_json(read_regular(folder / "config.json", MAX_CONFIG_BYTES))
    except (RefusedFile, ValueError, OSError):
        return "it has no config.json that moespec wrote"
    if not isinstance(config, dict) or config.get("architecture") != HUB_ARCHITECTURE:
        return f"its config.json does not name moespec's architecture ({HUB_ARCHITECTURE})"
    return None

"""moespec's own writer of the Hugging Face Hub layout: what `timm.models.save_for_hf` writes, with moespec's write
guarantees and a model card.

    save_for_hf(model, folder)           a model in memory (`moespec.save_for_hf`, `moespec compile --hub`)
    upcycle_to_hub(spec, folder, ...)    upcycled straight to the folder, one layer at a time (`upcycle --hub`)

The folder holds `config.json` (written by timm's `save_config_for_hf`: moespec's architecture, the spec of the
saved head in `model_args`, the pretrained_cfg; `write_config`), `model.safetensors` (one file, as timm's hub
reader takes it; the spec also in its header, so that it is a moespec checkpoint too) and `README.md`, a model
card: the spec, the `moespec stats` table and how to load the model. It is built in a temp folder beside `folder`
and renamed into place whole (`io.atomic_output`): a reader sees the previous folder or the new one, never a mix,
and nothing else is touched; it replaces only a Hub folder that moespec wrote (`hub_files`), with `force`. Upload
it with `huggingface_hub.upload_folder` (or `huggingface-cli upload`). transformers builds the same model from it
too (`AutoModelForImageClassification`, `TimmWrapperModel`: through timm, once moespec is imported).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from timm.models._hub import save_config_for_hf
from torch import nn

from ..compiler import create_model
from ..counting import render, stats
from ..errors import MoespecError
from ..io import atomic_output
from ..spec import HUB_SPEC_ARG, Spec, spec_metadata
from ..weights import save, upcycle_to_checkpoint
from ..weights.checkpoint import spec_of_head
from .hub_files import check_hub_output, not_a_hub_folder

WEIGHTS, CONFIG, CARD = "model.safetensors", "config.json", "README.md"
ONE_FILE = 2**62  # bytes: the weights in one file, the only form timm's hub reader takes


def save_for_hf(model: nn.Module, folder: str | Path, *, force: bool = False, model_config: dict | None = None,
                name: str | None = None) -> Path:
    """Write `model` (built by moespec) as a Hub folder (module docstring). `model_config` is timm's
    (`{"label_names": [...]}` for the class names); `name` titles the model card (default: the spec's name).
    An existing `folder` is replaced only with `force`. Returns the folder."""
    spec = getattr(model, "moespec_spec", None)
    if spec is None:
        raise MoespecError("this model was not built by moespec (no spec attached); build it with moespec.create_model")
    card_spec = spec_of_head(model, spec)[0]

    def weights(target: Path) -> None:
        save(model, target, max_shard_size=ONE_FILE)

    return _write_folder(folder, model, card_spec, weights, force=force, model_config=model_config, name=name)


def upcycle_to_hub(spec: Spec, folder: str | Path, *, force: bool = False, model_config: dict | None = None,
                   **upcycle: Any):
    """`weights.upcycle_to_checkpoint` into a Hub folder: the same weights, streamed to its model.safetensors.
    `upcycle`: that function's keyword arguments (`checkpoint`, `images`, `seed`, `dtype`, `check`, ...).
    Returns the folder and the check's report."""
    report = []

    def weights(target: Path) -> None:
        report.append(upcycle_to_checkpoint(spec, target, max_shard_size=ONE_FILE, **upcycle)[1])

    model = create_model(spec, device="meta")  # what timm's config writer reads: cfg, head, input size
    return _write_folder(folder, model, spec, weights, force=force, model_config=model_config), report[0]


def _write_folder(folder: str | Path, model: nn.Module, spec: Spec, weights: Callable[[Path], None], *,
                  force: bool, model_config: dict | None, name: str | None = None) -> Path:
    check_hub_output(folder, force)
    card = model_card(spec, name or spec.name or Path(folder).name)
    with atomic_output(folder, force=force, folder=True, ours=not_a_hub_folder) as building:
        weights(building / WEIGHTS)
        write_config(model, spec, building / CONFIG, model_config)
        (building / CARD).write_text(card, encoding="utf-8")
    return Path(folder)


def write_config(model: nn.Module, spec: Spec, file: Path, model_config: dict | None) -> None:
    """config.json: timm's `save_config_for_hf`, with `spec` (the model's, with its head as it is now) in
    `model_args`, and no `num_classes` there: the spec sizes the head. transformers' TimmWrapper passes its own
    `num_classes` (the root one, or 0 for `TimmWrapperModel`) beside the config's `model_args`, and a second one
    in them is Python's "got multiple values for keyword argument 'num_classes'". The root `num_classes` and
    `pretrained_cfg.num_classes` stay, as timm writes them."""
    save_config_for_hf(model, file, model_config=model_config, model_args={HUB_SPEC_ARG: spec_metadata(spec)})
    config = json.loads(file.read_text(encoding="utf-8"))
    config.get("model_args", {}).pop("num_classes", None)
    file.write_text(json.dumps(config, indent=2), encoding="utf-8")


def model_card(spec: Spec, name: str) -> str:
    """The README.md of a Hub folder: front matter for the Hub, the spec, its stats, and how to load it."""
    record = stats(spec)
    layers = f"{record.moe_layers} MoE layers, {record.experts_total} experts in all"
    return f"""---
tags:
- image-classification
- timm
- moespec
- mixture-of-experts
library_name: timm
---
# {name}

A Mixture-of-Experts model built by moespec (`pip install moespec`) from the timm backbone
`{spec.backbone.model}`: {layers}.

## Load it

Install moespec beside timm and import it: it registers this model's architecture with timm, which
otherwise refuses the folder (`Unknown model`) rather than build another model.

```python
import moespec, timm

model = timm.create_model("hf-hub:ORG/NAME", pretrained=True)      # or "local-dir:PATH/TO/FOLDER"
features = timm.create_model("hf-hub:ORG/NAME", pretrained=True, features_only=True)  # a dense-task backbone
model = moespec.load("PATH/TO/FOLDER")                              # the same model, through moespec
```

transformers builds it through timm as well, in any import order, once moespec is imported:

```python
import moespec
from transformers import AutoModelForImageClassification, TimmWrapperModel

model = AutoModelForImageClassification.from_pretrained("ORG/NAME")  # logits: model(pixel_values).logits
backbone = TimmWrapperModel.from_pretrained("ORG/NAME")              # no head: pooler_output
```

`moespec stats FOLDER` and `moespec plan FOLDER` print the figures below and the layer plan.

## Size

Parameters and GMACs per image at {record.input_size[1]}x{record.input_size[2]} (one fused multiply-add counts
as one MAC; activated: the experts that each item is routed to), with the dense backbone for comparison:

{render([record], "markdown").strip()}

## Spec

```yaml
{spec.to_yaml().strip()}
```
"""

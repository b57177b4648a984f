"""The dense side of upcycling: the backbone with the weights to start from (a .safetensors file, tensors
pickled in .pth / .pt / .bin / timm's .pth.tar training checkpoints, timm's pretrained weights or a fresh
init), fitted to the spec's model the way timm fits pretrained weights, and checked.

Fitting uses timm's own machinery: the model module's `checkpoint_filter_fn` (which resamples a ViT's
position embedding to a new `img_size`), timm's `clean_state_dict` (DDP / torch.compile prefixes) and the
pretrained_cfg's `classifier` name: a checkpoint head that does not fit `num_classes` is dropped and the
head keeps its fresh init, as `timm.create_model(..., pretrained=True, num_classes=N)` does.
"""

from __future__ import annotations

import importlib
import zipfile
from pathlib import Path
from typing import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from timm.models import clean_state_dict
from torch import nn

from ..backbones import create_backbone
from ..errors import CheckpointError, SpecError
from ..io import read_safetensors_header, read_safetensors_into, safetensors_shapes
from ..planning import checkpoint_problem
from ..spec import DENSE_SUFFIXES, Spec

TRAINING_KEYS = ("state_dict", "model")
"""Where a training checkpoint keeps its weights (timm's train.py: "state_dict"; others: "model")."""
EMA_KEYS = ("state_dict_ema", "model_ema")
"""... and its EMA weights (timm's train.py with --model-ema)."""


def read_state_dict(path: str | Path, *, trust_pickle: bool = False, ema: bool = False,
                    max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """A state dict from .safetensors, or a pickled .pth / .pt / .bin / .pth.tar file: plain tensors, or a
    training checkpoint holding them under "state_dict" or "model" (with `ema`, "state_dict_ema" or
    "model_ema"), with DDP's "module." prefix removed.

    Pickled files are read with `weights_only=True`; a file that needs arbitrary unpickling (timm's training
    checkpoints hold an argparse Namespace) is refused unless `trust_pickle`, since unpickling can run any
    code the file's author wrote.

    `max_bytes` (`weight_cap` of the model it is for): the most that the file's tensors may take once read, checked
    before any is read (a safetensors header's offsets, a zip's declared record sizes); more is a CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if not path.name.endswith(DENSE_SUFFIXES):
        raise CheckpointError(f"{path}: unknown checkpoint type {path.suffix!r}; expected one of "
                              f"{', '.join(DENSE_SUFFIXES)}")
    if path.suffix == ".safetensors":
        header, _ = read_safetensors_header(path)  # a damaged header gets its precise error
        data = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0)
        _refuse_over(path, data, max_bytes, "its header's tensors take")
        try:
            state = load_file(str(path))
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{path}: cannot read safetensors ({err}); is it truncated?") from None
    else:
        state = _unpickle(path, trust_pickle, max_bytes)
    if isinstance(state, dict):
        keys = [k for k in (EMA_KEYS if ema else ()) + TRAINING_KEYS if isinstance(state.get(k), dict)]
        if ema and not any(k in EMA_KEYS for k in keys):
            raise CheckpointError(f"{path}: has no EMA weights (no {' / '.join(EMA_KEYS)}); leave out --ema")
        state = state[keys[0]] if keys else state
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a mapping of tensor names to tensors, or a training checkpoint with "
                              f"one under {' / '.join(TRAINING_KEYS + EMA_KEYS)}")
    return clean_state_dict(state)


MAX_INFLATION = 16
"""How much larger than its file a pickled checkpoint's zip records may say they are: torch.save stores them
uncompressed (1 x), so more is a zip bomb (a 1.9 MB file that inflated to 2 GB in memory before it was refused)."""


WEIGHT_MARGIN, WEIGHT_SLACK = 4, 2**20
"""A model's weight file may hold up to 4 x its state's bytes, plus 1 MiB (float64 tensors, a training
checkpoint's extra state, pickle records): `weight_cap`."""


def weight_cap(model: nn.Module) -> int:
    """The most bytes a weight file for `model` may inflate to (`WEIGHT_MARGIN`); from the model's own tensors,
    a meta build's too."""
    state = model.state_dict()
    return WEIGHT_MARGIN * sum(t.numel() * t.element_size() for t in state.values()) + WEIGHT_SLACK


def _refuse_over(path: Path, declared: int, max_bytes: int | None, what: str) -> None:
    if max_bytes is not None and declared > max_bytes:
        raise CheckpointError(f"{path}: {what} {declared:,} bytes, more than the {max_bytes:,} that the model's "
                              f"weights can take ({WEIGHT_MARGIN} x its tensors' bytes); a file for another, larger "
                              f"model, or a zip bomb. Refusing to read it")


def _refuse_inflation(path: Path, max_bytes: int | None = None) -> None:
    """Refuse a zip checkpoint whose records declare more than `MAX_INFLATION` x the file's size, or more than
    `max_bytes`, unread."""
    if not zipfile.is_zipfile(path):  # the legacy (pre-1.6) format is no zip; torch.load reads it as it is
        return
    try:
        with zipfile.ZipFile(path) as archive:
            declared = sum(record.file_size for record in archive.infolist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return  # torch.load says what is wrong with it
    _refuse_over(path, declared, max_bytes, "its zip records inflate to")
    size = max(path.stat().st_size, 1)
    if declared > MAX_INFLATION * size:
        raise CheckpointError(f"{path}: its zip records inflate to {declared:,} bytes, {declared // size:,} x the "
                              f"file's {size:,}; torch.save stores tensors uncompressed, so this is not a checkpoint "
                              f"it wrote. Refusing to inflate it")


def _unpickle(path: Path, trust_pickle: bool, max_bytes: int | None = None) -> object:
    _refuse_inflation(path, max_bytes)
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except (RuntimeError, EOFError, OSError) as err:  # a torch zip archive cut short, or not one at all
        raise CheckpointError(f"{path}: cannot read checkpoint ({type(err).__name__}: {err}); is it a complete "
                              f"PyTorch checkpoint?") from None
    except Exception as err:  # torch.load's weights_only refusals are pickle.UnpicklingError
        first = str(err).strip().splitlines()[-1] if str(err).strip() else err.__class__.__name__
        raise CheckpointError(f"{path}: refused to unpickle ({first[:200]}); moespec loads plain tensors only. If you "
                              f"trust this file, pass --trust-pickle (trust_pickle=True): unpickling can run "
                              f"arbitrary code. timm's training checkpoints need it: they hold the run's arguments"
                              ) from None


def check_state_dict(state: Mapping[str, torch.Tensor | tuple[int, ...]],
                     reference: nn.Module | Mapping[str, torch.Tensor], what: str) -> None:
    """Raise a CheckpointError naming the first missing / unexpected keys and mismatched shapes. `state` maps
    names to tensors, or to shapes (read from file headers without loading the data); `reference` is the
    model, or the part of its state dict to check."""
    wanted = reference.state_dict() if isinstance(reference, nn.Module) else reference
    expected = {k: tuple(v.shape) for k, v in wanted.items()}
    shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v) for k, v in state.items()}
    missing = [k for k in expected if k not in shapes]
    unexpected = [k for k in shapes if k not in expected]
    mismatched = [f"{k}: checkpoint {shapes[k]} vs model {expected[k]}"
                  for k in expected if k in shapes and shapes[k] != expected[k]]
    if missing or unexpected or mismatched:
        lines = [f"{what} does not fit the backbone:"]
        found = (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", mismatched))
        for title, items in found:
            if items:
                more = f" (+{len(items) - 5} more)" if len(items) > 5 else ""
                lines.append(f"  {len(items)} {title}: {', '.join(items[:5])}{more}")
        raise CheckpointError("\n".join(lines))


def fit_to_model(state: dict[str, torch.Tensor], model: nn.Module, what: str = "checkpoint"
                 ) -> tuple[dict[str, torch.Tensor], list[str], frozenset[str]]:
    """`state` fitted to `model` as timm fits pretrained weights, one line per change made, and the names that
    keep the model's fresh init: the model module's `checkpoint_filter_fn` (a new `img_size` resamples the
    position embedding), then the head: a checkpoint head of another shape, or none, leaves the model's freshly
    initialized head in place. A checkpoint that does not fit, before or after the filter, is a
    CheckpointError naming the file's own keys (`what` names the file)."""
    notes = []
    before = {k: tuple(v.shape) for k, v in state.items()}
    own = model.state_dict()
    classifier = model.pretrained_cfg.get("classifier") if hasattr(model, "pretrained_cfg") else None
    heads = [classifier] if isinstance(classifier, str) else list(classifier or ())
    filter_fn = getattr(importlib.import_module(type(model).__module__), "checkpoint_filter_fn", None)
    if filter_fn is not None:
        original = state
        try:  # a checkpoint of another family makes timm's filter fail on a key it expects (KeyError, ...)
            state = filter_fn(state, model)
        except Exception:  # timm says so with KeyError, RuntimeError, AssertionError...: the file's own keys say why
            _refuse_unfit(original, model, heads, f"{what} (keys as the file names them; a "
                          f"{type(model).__name__} is built)")
            raise
        if not _fits(state, own, heads):  # report the file's own keys, not the names the filter gave them
            renamed = state.keys() != original.keys()
            _refuse_unfit(original, model, heads, f"{what} (keys as the file names them; a "
                          f"{type(model).__name__} is built)" if renamed else what)
        notes += [f"{k} resampled from {list(before[k])} to {list(v.shape)} (timm's checkpoint filter)"
                  for k, v in state.items() if k in before and tuple(v.shape) != before[k]]
    head_keys = [k for k in own if any(k.startswith(f"{head}.") for head in heads)]
    held = [k for k in state if any(k.startswith(f"{head}.") for head in heads)]
    if head_keys and not held:
        notes.append(f"head: the checkpoint has none; {', '.join(heads)} keeps its fresh init "
                     f"({getattr(model, 'num_classes', '?')} classes)")
    elif held and any(k not in own or tuple(state[k].shape) != tuple(own[k].shape) for k in held):
        rows = state[held[0]].shape[0]
        state = {k: v for k, v in state.items() if k not in held}
        notes.append(f"head: the checkpoint's ({rows} classes) does not fit {getattr(model, 'num_classes', '?')} "
                     f"classes; dropped, {', '.join(heads)} freshly initialized")
    fresh = frozenset(k for k in head_keys if k not in state)
    return {**{k: own[k] for k in fresh}, **state}, notes, fresh


def _fits(state: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], heads: list[str]) -> bool:
    """The names and shapes of `state` are the model's (`own`), a head aside: `fit_to_model` drops a head of
    another shape, and a model keeps its fresh head where the checkpoint has none."""
    def body(names):
        return {k for k in names if not any(k.startswith(f"{head}.") for head in heads)}

    return body(state) == body(own) and all(tuple(state[k].shape) == tuple(own[k].shape) for k in body(state))


def _refuse_unfit(state: Mapping[str, torch.Tensor], model: nn.Module, heads: list[str], what: str) -> None:
    """`check_state_dict` of the checkpoint as its file holds it (a head aside, see `_fits`): a checkpoint of
    another family (Swin's into a ConvNeXt) is a CheckpointError with the file's keys."""
    def body(names):
        return {k: v for k, v in names.items() if not any(k.startswith(f"{head}.") for head in heads)}

    check_state_dict(body(state), body(model.state_dict()), what)


def dense_model(spec: Spec, checkpoint: str | Path | None = None, *,
                trust_pickle: bool = False) -> tuple[nn.Module, str]:
    """The dense backbone with the weights to upcycle from, and a description of their source (with what
    fitting them to the spec's model changed, see `fit_to_model`).

    Source, first that applies: `checkpoint`, the spec's `backbone.checkpoint` (relative to the spec file),
    timm's pretrained weights if `backbone.pretrained`, else timm's fresh random init.
    """
    dense, source, _ = dense_model_and_fresh(spec, checkpoint, trust_pickle=trust_pickle)
    return dense, source


def dense_model_and_fresh(spec: Spec, checkpoint: str | Path | None = None, *,
                          trust_pickle: bool = False) -> tuple[nn.Module, str, frozenset[str]]:
    """`dense_model`, and the names of the tensors that keep the model's fresh init because the checkpoint
    has none that fits (a head for other classes): averaging several sources leaves them out."""
    fresh: frozenset[str] = frozenset()
    if checkpoint is None and spec.backbone.checkpoint is not None:
        problem = checkpoint_problem(spec)
        if problem is not None:
            raise SpecError(problem)
        checkpoint = spec.resolve_path(spec.backbone.checkpoint)
    if checkpoint is not None:
        dense = create_backbone(spec)
        notes = []
        if _fits_as_is(checkpoint, dense):  # read in place: no second copy of a large file
            read_safetensors_into(checkpoint, dense.state_dict())
        else:
            state, notes, fresh = fit_to_model(read_state_dict(checkpoint, trust_pickle=trust_pickle), dense,
                                               f"checkpoint {checkpoint}")
            check_state_dict(state, dense, f"checkpoint {checkpoint}")
            dense.load_state_dict(state)
        source, origin = "; ".join([str(checkpoint), *notes]), str(checkpoint)
    elif spec.backbone.pretrained:
        dense, source = create_backbone(spec, pretrained=True), f"timm pretrained {spec.backbone.model}"
        cfg = getattr(dense, "pretrained_cfg", None) or {}
        where = cfg.get("file") or cfg.get("hf_hub_id") or cfg.get("url") or "timm's cache"
        origin = f"{spec.source or spec.name}: backbone.pretrained: timm's weights for {spec.backbone.model} ({where})"
    else:
        dense, source = create_backbone(spec), f"fresh {spec.backbone.model} (random init)"
        origin = f"{spec.source or spec.name}: backbone: a fresh {spec.backbone.model}"
    buffers = {name for name, _ in dense.named_buffers()}
    refuse_non_finite(dense.state_dict(), origin, buffers)  # every source: timm's pretrained loader checks nothing
    return dense, source, fresh


def _fits_as_is(checkpoint: str | Path, model: nn.Module) -> bool:
    """A safetensors file whose header names exactly the model's tensors at their shapes."""
    if Path(checkpoint).suffix != ".safetensors" or not Path(checkpoint).is_file():
        return False
    return safetensors_shapes(checkpoint) == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def refuse_non_finite(state: dict[str, torch.Tensor], source: str, buffers: set[str] = frozenset()) -> None:
    """Upcycling copies weights into every expert: a NaN or Inf would poison them all. The `buffers` may hold
    +-Inf, not NaN (a bound: Gemma 4's clippable linears are unbounded until a checkpoint bounds them)."""
    bad = [name for name, t in state.items() if t.is_floating_point()
           and not (t.isnan().any().logical_not() if name in buffers else torch.isfinite(t).all())]
    if bad:
        more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
        raise CheckpointError(f"{source}: {', '.join(bad[:3])}{more} hold NaN or Inf values; refusing to upcycle "
                              f"from a diverged or corrupted checkpoint")

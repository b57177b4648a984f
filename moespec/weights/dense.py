"""The dense side of upcycling: the backbone with the weights to start from (a .safetensors file, plain tensors
pickled in .pth / .pt / .bin, timm's pretrained weights or a fresh init), checked against the model."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from ..backbones import create_backbone
from ..errors import CheckpointError, SpecError
from ..io import read_safetensors_into, safetensors_shapes
from ..planning import checkpoint_problem
from ..spec import DENSE_SUFFIXES, Spec


def read_state_dict(path: str | Path, *, trust_pickle: bool = False) -> dict[str, torch.Tensor]:
    """A dense state dict from .safetensors, or .pth / .pt / .bin (plain, or under "state_dict" / "model").

    Pickled files are read with `weights_only=True`; a file that needs arbitrary unpickling (a training
    checkpoint holding an argparse Namespace, say) is refused unless `trust_pickle`, since unpickling can run
    any code the file's author wrote."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if path.suffix not in DENSE_SUFFIXES:
        raise CheckpointError(f"{path}: unknown checkpoint type {path.suffix!r}; expected one of "
                              f"{', '.join(DENSE_SUFFIXES)}")
    try:
        if path.suffix == ".safetensors":
            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except (SafetensorError, RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot read checkpoint ({type(err).__name__}: {err}); is it truncated or not "
                              f"a checkpoint?") from None
    except Exception as err:  # torch.load's weights_only refusals are pickle.UnpicklingError
        first = str(err).strip().splitlines()[-1] if str(err).strip() else err.__class__.__name__
        raise CheckpointError(f"{path}: refused to unpickle ({first[:200]}); moespec loads plain tensors only. If you "
                              f"trust this file, pass --trust-pickle (trust_pickle=True): unpickling can run "
                              f"arbitrary code") from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a mapping of tensor names to tensors")
    if state and all(k.startswith("module.") for k in state):  # saved from DistributedDataParallel
        state = {k.removeprefix("module."): v for k, v in state.items()}
    return state


def check_state_dict(state: Mapping[str, torch.Tensor | tuple[int, ...]], reference: nn.Module, what: str) -> None:
    """Raise a CheckpointError naming the first missing / unexpected keys and mismatched shapes. `state` maps
    names to tensors, or to shapes (read from file headers without loading the data)."""
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
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


def dense_model(spec: Spec, checkpoint: str | Path | None = None, *,
                trust_pickle: bool = False) -> tuple[nn.Module, str]:
    """The dense backbone with the weights to upcycle from, and a description of their source.

    Source, first that applies: `checkpoint`, the spec's `backbone.checkpoint` (relative to the spec file),
    timm's pretrained weights if `backbone.pretrained`, else timm's fresh random init.
    """
    if checkpoint is None and spec.backbone.checkpoint is not None:
        problem = checkpoint_problem(spec)
        if problem is not None:
            raise SpecError(problem)
        checkpoint = spec.resolve_path(spec.backbone.checkpoint)
    if checkpoint is not None:
        dense = create_backbone(spec)
        if Path(checkpoint).suffix == ".safetensors" and Path(checkpoint).is_file():  # read in place: no second copy
            check_state_dict(safetensors_shapes(checkpoint), dense, f"checkpoint {checkpoint}")
            read_safetensors_into(checkpoint, dense.state_dict())
        else:
            state = read_state_dict(checkpoint, trust_pickle=trust_pickle)
            check_state_dict(state, dense, f"checkpoint {checkpoint}")
            dense.load_state_dict(state)
        refuse_non_finite(dense.state_dict(), str(checkpoint))
        return dense, str(checkpoint)
    if spec.backbone.pretrained:
        return create_backbone(spec, pretrained=True), f"timm pretrained {spec.backbone.model}"
    return create_backbone(spec), f"fresh {spec.backbone.model} (random init)"


def refuse_non_finite(state: dict[str, torch.Tensor], source: str) -> None:
    """Upcycling copies weights into every expert: a NaN or Inf would poison them all."""
    bad = [name for name, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
        raise CheckpointError(f"{source}: {', '.join(bad[:3])}{more} hold NaN or Inf values; refusing to upcycle "
                              f"from a diverged or corrupted checkpoint")

"""Checks of a spec that its dense model answers: the input size it takes, and the dense checkpoint it names."""

from __future__ import annotations

import types
from typing import Any

from ..errors import Problem, SpecError
from ..spec import DENSE_SUFFIXES, BackboneSketch, FieldError, Spec, located, read_document, spec_problem


def checkpoint_problem(spec: Spec) -> Problem | None:
    """A Problem at `backbone.checkpoint` when it is not a dense checkpoint file moespec can read, else None."""
    if spec.backbone.checkpoint is None:
        return None
    path = spec.resolve_path(spec.backbone.checkpoint)
    if not path.name.endswith(DENSE_SUFFIXES):
        return spec_problem(spec, "backbone.checkpoint", f"unknown checkpoint type {path.suffix!r} of {str(path)!r}; "
                                                         f"expected one of {', '.join(DENSE_SUFFIXES)}")
    if not path.is_file():
        return spec_problem(spec, "backbone.checkpoint", f"no such checkpoint file {str(path)!r}; a relative path is "
                                                         f"relative to the spec file's folder")
    return None


def model_name_problems(file: str, error: SpecError) -> list[Problem]:
    """What timm says of the spec file `file`'s `backbone.model` when its validation failed with `error` for
    other reasons (a bad top_k): an unknown name at its line, so that one run reports every problem. [] when
    the name is fine, is not a name, or `error` is already about it."""
    if any(p.path.startswith("backbone.model") for p in error.problems):
        return []
    try:
        data, positions = read_document(file)
    except SpecError:  # not a YAML mapping: `error` says so
        return []
    backbone = data.get("backbone") if isinstance(data, dict) else None
    name = backbone.get("model") if isinstance(backbone, dict) else None
    if not isinstance(name, str):
        return []
    from ..backbones.create import unknown_model_problem  # timm's import (seconds), only for a failed spec

    unknown = unknown_model_problem(name)
    if unknown is None:
        return []
    line, column = positions.find(["backbone", "model"])
    return [Problem(unknown.message, path=unknown.path, file=file, line=line, column=column)]


INPUT_SIZE_ERRORS = (AssertionError, RuntimeError, ValueError, TypeError, OverflowError)
"""What a backbone raises on an input size it cannot take: ViT's patch embed asserts, a conv kernel larger
than the image is a RuntimeError, a size beyond int64 a TypeError."""


def input_refusal(model: Any, input_size: tuple[int, int, int], *, batch: int = 1) -> str | None:
    """Run `model` (built on the meta device: shapes only) on one input of `input_size` (or a batch of them);
    why it refuses it, in one line, or None when it takes it."""
    import torch  # only with a model in hand: a plan from a cached sketch needs no torch

    dropped = _dropped_by_patches(model, input_size)
    if dropped is not None:
        return dropped
    rnns = [m for m in model.modules() if isinstance(m, torch.nn.RNNBase)]
    for rnn in rnns:  # torch's meta RNN kernels decompose step by step: Sequencer's LSTMs took 4 s of a 6 s plan
        rnn.forward = types.MethodType(_rnn_shape, rnn)
    try:
        with torch.no_grad():
            model(torch.empty(batch, *input_size, device="meta"))
    except INPUT_SIZE_ERRORS as error:
        return _reason(error)
    finally:
        for rnn in rnns:
            del rnn.forward
    return None


def _dropped_by_patches(model: Any, input_size: tuple[int, int, int]) -> str | None:
    """Why a patch embedding built for exactly this size (timm's `strict_img_size`) would drop pixels: timm takes
    an `img_size` that its patches do not divide and cuts each side down to a whole number of patches (a 100 px
    image into 6 patches of 16 px: the last 4 px unseen). Where timm pads (`dynamic_img_pad`) or checks the
    size itself (a dynamic size), None."""
    embed = getattr(model, "patch_embed", None)
    patch = getattr(embed, "patch_size", None)
    if not getattr(embed, "strict_img_size", False) or getattr(embed, "dynamic_img_pad", False) or not patch:
        return None
    sides = [side % step for side, step in zip(input_size[1:], patch, strict=True)]
    if not any(sides):
        return None
    whole = [side - rest for side, rest in zip(input_size[1:], sides, strict=True)]
    return (f"its {list(patch)} px patches do not divide {list(input_size[1:])}: timm would drop the last "
            f"{sides} px of each side; give a multiple of the patch, e.g. {whole}")


def _rnn_shape(rnn: Any, x: Any, hx: Any = None) -> tuple[Any, None]:
    """An RNN's output [..., T, D * width] for a shape-only run (its hidden state is not computed)."""
    width = rnn.proj_size or rnn.hidden_size
    return x.new_empty(*x.shape[:-1], width * (2 if rnn.bidirectional else 1)), None


def _reason(error: Exception) -> str:
    return str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__


def input_size_problem(spec: Spec, input_size: tuple[int, int, int], reason: Exception | str) -> Problem:
    """A Problem at `input_size` for why the backbone refused an input of that size (its error, or its text)."""
    if isinstance(reason, Exception):
        reason = _reason(reason)
    return spec_problem(spec, "input_size", f"the model cannot take input size {list(input_size)}: {reason}; models "
                                            f"with a fixed input size take it as img_size (and in_chans) in "
                                            f"backbone.kwargs")


def input_size_error(spec: Spec, input_size: tuple[int, int, int], reason: Exception | str, *, batch: int = 1,
                     step: str) -> SpecError:
    """The SpecError at `input_size` for a failure of `step` (counting MACs, measuring a forward) at that size,
    when the input size is the cause: the plain dense forward, on the meta device, refuses it too. Otherwise
    the failure is moespec's, not the spec's, and no field is blamed: a RuntimeError is raised, naming the
    step and its error."""
    from ..backbones import create_backbone  # timm's import (seconds): a plan from a cached sketch needs none

    refusal = input_refusal(create_backbone(spec, device="meta"), input_size, batch=batch)
    if refusal is not None:
        return SpecError(input_size_problem(spec, input_size, refusal))
    text = reason if isinstance(reason, str) else f"{type(reason).__name__}: {_reason(reason)}"
    raise RuntimeError(f"{step} of {spec.backbone.model} at input size {list(input_size)} failed, though the "
                       f"model takes that input: {text}")


def input_size_of(spec: Spec, sketch: BackboneSketch) -> tuple[int, int, int]:
    """The spec's input_size, else the backbone's pretrained_cfg input size adjusted by img_size / in_chans."""
    return spec_input_size(spec, sketch.input_size)


def spec_input_size(spec: Spec, pretrained_input_size: tuple[int, int, int]) -> tuple[int, int, int]:
    """`input_size_of` given the backbone's pretrained_cfg input size, for a caller that has it without a
    sketch (timm's registry: `apps.timm_registry`)."""
    if spec.input_size is not None:
        return spec.input_size
    channels, height, width = pretrained_input_size
    kwargs = spec.backbone.kwargs
    if kwargs.get("in_chans") is not None:  # timm ignores kwargs that are None
        channels = kwargs["in_chans"]
    size = kwargs.get("img_size")
    if size is not None:
        height, width = size if isinstance(size, (list, tuple)) and len(size) == 2 else (size, size)
    if not all(isinstance(n, int) and n > 0 for n in (channels, height, width)):
        raise located(spec, SpecError(Problem(
            f"cannot tell the input size from img_size {size!r} / in_chans {kwargs.get('in_chans')!r}; give "
            f"img_size as an integer or [height, width], or set input_size", path="backbone.kwargs")))
    return (int(channels), int(height), int(width))


def items_problems(spec: Spec, layers: Any, items_per_image: dict[str, int]) -> list[Problem]:
    """Each router's checks against the items per image a forward or trace found at its layer (`path` ->
    items), for the `planning.LayerPlan`s `layers`: Soft MoE's identity routing needs one slot per token."""
    problems = []
    for layer in layers:
        if layer.path not in items_per_image:
            continue
        try:
            layer.router.check_items(layer, items_per_image[layer.path])
        except FieldError as error:
            problems.append(spec_problem(spec, f"moe.{layer.group}.router.{error.field}", str(error)))
    return problems

"""The dense timm backbone of a spec: `timm.create_model` with the spec's kwargs, and errors that say which
kwarg timm refused and what the model takes."""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
from typing import Iterator

import timm
import timm.models
import torch
from torch import nn

from ..errors import Problem, SpecError, did_you_mean
from ..spec import Backbone, Spec, located
from .meta import SkipMetaWrites
from .placement import TooManyModules, module_budget, refuse_if_too_large, resolve_device
from .pre_logits import add_pre_logits
from .pretrained import create_pretrained


def create_backbone(spec: Spec, *, device: str | torch.device = "cpu", pretrained: bool = False,
                    check_memory: bool = True) -> nn.Module:
    """`timm.create_model` for the spec's backbone, built on `device` (every parameter and buffer is created
    there); `device="meta"` builds it without allocating weights.

    With `check_memory`, a backbone for a real device is first built on the meta device and counted: one that
    would not fit in the device's memory is refused before anything is allocated (`placement`).
    Errors name the spec file and line of `backbone.model` / `backbone.kwargs`.
    """
    device = resolve_device(device)
    try:
        if check_memory and device.type != "meta":
            refuse_if_too_large(_create(spec.backbone, torch.device("meta"), False), device,
                                 f"its dense backbone {spec.backbone.model}", "backbone")
        return _create(spec.backbone, device, pretrained)
    except SpecError as error:
        raise located(spec, error) from None


def unknown_model_problem(name: str) -> Problem | None:
    """A Problem at `backbone.model` when timm has no model `name` (with the closest names), else None."""
    if timm.is_model(name):
        return None
    matches = timm.list_models(f"*{name.split('_')[0]}*")[:8] if name else []
    hint = did_you_mean(name, timm.list_models()) or (
        f"; timm models like it: {', '.join(matches)}" if matches else "; timm.list_models() lists them")
    return Problem(f"unknown timm model {name!r}{hint}", path="backbone.model")


def _create(backbone: Backbone, device: torch.device, pretrained: bool) -> nn.Module:
    unknown = unknown_model_problem(backbone.model)
    if unknown is not None:
        raise SpecError(unknown)
    kwargs, overrides = dict(backbone.kwargs), {}
    while True:
        try:
            # SkipMetaWrites: timm's initialization of the parameters that are on the meta device (all of them on
            # device="meta", all in `create_weightless_backbone`) costs nothing
            with device, _override_builder_kwargs(backbone.model, overrides), SkipMetaWrites(), module_budget():
                if pretrained:  # from the cache, or the network if a probe reaches it: no minute of retries
                    model = create_pretrained(lambda: timm.create_model(backbone.model, pretrained=True, **kwargs),
                                            backbone.model).eval()
                else:
                    model = timm.create_model(backbone.model, **kwargs).eval()
                if backbone.pre_logits:
                    model = add_pre_logits(model, backbone.model)
            break
        except SpecError:  # a check of moespec's own (pre_logits), already located at its field
            raise
        except TooManyModules as err:
            raise SpecError(Problem(
                f"{backbone.model} with these kwargs has more than {err.args[0]:,} modules (the largest timm "
                f"backbones have under 3,000); refusing to build it, even for a plan: check depth / depths",
                path="backbone.kwargs" if backbone.kwargs else "backbone.model")) from None
        except TypeError as err:
            fixed = re.search(r"got multiple values for keyword argument '(\w+)'", str(err))
            if fixed is None or fixed.group(1) not in kwargs:
                raise SpecError(Problem(f"timm rejected the kwargs for {backbone.model!r}: {_one_line(err)}"
                                        + _argument_hint(backbone.model, str(err)), path="backbone.kwargs"),
                                timm_error=err) from None
            overrides[fixed.group(1)] = kwargs.pop(fixed.group(1))
        except Exception as err:  # timm's own checks of the values, e.g. "dim should be divisible by num_heads"
            if pretrained:
                raise SpecError(_pretrained_problem(backbone, err), timm_error=err) from None
            if not backbone.kwargs:
                raise
            raise SpecError(Problem(f"timm could not build {backbone.model!r} with these kwargs: "
                                    f"{type(err).__name__}: {_one_line(err)}", path="backbone.kwargs"),
                            timm_error=err) from None
    return _take_padded_inputs(model)


def _take_padded_inputs(model: nn.Module) -> nn.Module:
    """Let a patch embedding with timm's `dynamic_img_pad` take every input that pads to its patch grid.

    `dynamic_img_pad` pads an input up to a multiple of the patch size, but timm's `PatchEmbed` still asks for
    exactly `img_size` unless `dynamic_img_size` is set too (`strict_img_size`). So DINOv2-S/14 (img_size 518 =
    37 x 14) refused the 512 px input of seed 003's ADE20K runs, which pads to the same 37 x 37 patches and fits
    its pretrained position table as it is. Any other size is still refused, by the position table. With an
    `img_size` that is not a multiple of the patch, timm makes a table for the floor of the grid (36 x 36 at 512)
    that no padded input fits: refused here, with what to write instead."""
    embed = getattr(model, "patch_embed", None)
    if not getattr(embed, "dynamic_img_pad", False) or not getattr(embed, "strict_img_size", False):
        return model
    size, patch = tuple(embed.img_size), tuple(embed.patch_size)
    if any(s % p for s, p in zip(size, patch, strict=True)):
        grid = [s // p for s, p in zip(size, patch, strict=True)]
        padded_grid = [-(-s // p) for s, p in zip(size, patch, strict=True)]
        raise SpecError(Problem(
            f"img_size {list(size)} with dynamic_img_pad: timm makes a position table for {grid} patches of "
            f"{list(patch)}, but pads inputs of that size to {padded_grid}; give img_size "
            f"{[g * p for g, p in zip(padded_grid, patch, strict=True)]} "
            f"(inputs that pad to it are taken) or add dynamic_img_size: true", path="backbone.kwargs"))
    embed.strict_img_size = False
    return model


def _pretrained_problem(backbone: Backbone, error: Exception) -> Problem:
    """Why timm's pretrained weights could not be had: a download that failed (an OSError: no network, the Hub
    offline, a missing file; hub and requests errors are OSErrors), or weights that do not fit the model."""
    cause = f"{type(error).__name__}: {_one_line(error)}"
    cause = cause if len(cause) <= 120 else cause[:117] + "..."
    if isinstance(error, OSError):
        return Problem(f"could not download timm's pretrained weights for {backbone.model!r} ({cause}); with no "
                       f"network, save them to a .safetensors or .pth file and name it in backbone.checkpoint (or "
                       f"upcycle --checkpoint) instead", path="backbone.pretrained")
    fit = " with these kwargs" if backbone.kwargs else ""
    return Problem(f"timm could not load its pretrained weights for {backbone.model!r}{fit} ({cause}); give a dense "
                   f"checkpoint in backbone.checkpoint instead of pretrained: true", path="backbone.pretrained")


def _one_line(error: Exception) -> str:
    """An exception's message on one line (a kwarg's name may hold a newline; the CLI prints a line per problem)."""
    return " ".join(str(error).split())


def _argument_hint(name: str, error: str) -> str:
    """For `X.__init__() got an unexpected keyword argument 'a'`: the arguments timm's class X takes."""
    found = re.search(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'", error)
    module = sys.modules[timm.models.model_entrypoint(name).__module__]
    model_class = getattr(module, found.group(1), None) if found else None
    if not isinstance(model_class, type):
        return ""
    parameters = inspect.signature(model_class.__init__).parameters.values()
    names = [p.name for p in parameters if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return did_you_mean(found.group(2), names) or f"; {found.group(1)} takes: {', '.join(names)}"


@contextlib.contextmanager
def _override_builder_kwargs(name: str, overrides: dict) -> Iterator[None]:
    """Let kwargs override what a timm entry point hard-codes (e.g. `num_blocks` of `mixer_b16_224`).

    timm entry points build `dict(num_blocks=12, ..., **kwargs)`, so passing `num_blocks` again fails. Every
    timm family then calls `build_model_with_cfg(model_cls, variant, pretrained, **model_args)` from its own
    module; for the length of one `create_model` we wrap that name to apply the overrides.
    """
    if not overrides:
        yield
        return
    module = sys.modules[timm.models.model_entrypoint(name).__module__]
    original = module.build_model_with_cfg

    def build(model_cls, variant, pretrained, **model_args):
        return original(model_cls, variant, pretrained, **{**model_args, **overrides})

    module.build_model_with_cfg = build
    try:
        yield
    finally:
        module.build_model_with_cfg = original

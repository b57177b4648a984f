"""Sparse upcycling (Komatsuzaki et al. 2023): start an MoE model from dense ones, in memory.

Every non-FFN weight is copied from the base dense model; each routed expert is a copy of its source's dense
FFN (one source, or several: `sources.py`), or of a subset of its hidden units when experts are narrower
(`split: slice` gives every expert the leading units, `split: partition` gives expert i the i-th block); shared
experts copy the base's FFN. Drop-Upcycling (`drop: r`) re-initializes a fraction r of each routed expert's
hidden units. Routers start N(0, 0.02^2), at zero, or from data (`router_start.py`).

Two ways, the same weights for the same seed:
    upcycle / upcycle_with_report   the whole MoE model in memory (to train it right away)
    upcycle_to_checkpoint           streams to (sharded) safetensors: the dense model plus one MoE layer at a
                                    time are in memory, never the whole MoE model (`streaming.py`)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from ..compiler import create_model, moe_layers
from ..errors import SpecError
from ..layers import MoELayer
from ..planning import LayerPlan, Plan, items_problems
from ..planning.forward_cost import refuse_costly_forward
from ..spec import RouterSpec, Spec, spec_problem
from .dense import dense_model
from .expert_fill import copy_ffn, fill_banks
from .mapping import dense_to_moe
from .router_start import Batches, ImageSet, check_image_sets, describe_start, image_sets, router_rows
from .sources import Checkpoints, Sources, expert_sources, read_sources


@dataclass(frozen=True)
class LayerStart:
    """Where one MoE layer's routed experts came from (a source index per expert) and how its router started."""

    path: str
    experts_from: tuple[int, ...]
    router: str


@dataclass(frozen=True)
class UpcycleReport:
    """How closely the upcycled model computes the dense function at initialization."""

    source: str  # where the dense weights came from
    max_abs_logit_diff: float
    max_abs_logit: float
    caveats: tuple[str, ...] = ()  # what in the spec changes the function, from `caveats(plan)`
    scope: str = "model"  # "model": logits of the whole model; "layers": each MoE layer against its dense FFN
    sources: tuple[str, ...] = ()  # each source checkpoint's description, in order (source 0 first)
    base: str = ""  # where everything outside the routed experts came from
    starts: tuple[LayerStart, ...] = ()  # per MoE layer (rebuilt blocks left out): expert sources, router start
    drop: float = 0.0  # Drop-Upcycling's re-initialized fraction of each routed expert's hidden units
    source_errors: tuple[float, ...] = ()  # ||MoE logits - source i's dense logits|| / ||source i's||, per source
    compared_on: str = ""  # the inputs of the logit comparisons

    def start_lines(self) -> list[str]:
        """What the upcycle started from, in words: the sources (where there are several), then per layer each
        expert's source and the router's start, then how far the MoE logits are from each source's dense model."""
        lines = []
        if len(self.sources) > 1:  # one source is the `source` line
            lines += [f"source {i}: {name}" for i, name in enumerate(self.sources)]
            lines.append(f"outside the experts: {self.base}")
        drop = f"; drop {self.drop:g} of each expert's hidden units re-initialized" if self.drop else ""
        for start in self.starts:
            lines.append(f"{start.path}: experts from sources [{' '.join(map(str, start.experts_from))}]; router "
                         f"{start.router}{drop}")
        if self.source_errors:
            errors = ", ".join(f"source {i} {error:.4g}" for i, error in enumerate(self.source_errors))
            lines.append(f"relative logit error ||MoE - dense|| / ||dense|| on {self.compared_on}: {errors}")
        return lines

    @property
    def function_preserving(self) -> bool:
        """Equal to the dense model up to fp32 rounding (1e-5, relative to the logit scale when it is > 1)."""
        return self.max_abs_logit_diff <= 1e-5 * max(1.0, self.max_abs_logit)

    def __str__(self) -> str:
        verdict = "yes" if self.function_preserving else "no"
        lines = [f"function-preserving: {verdict} (max |dlogit| = {self.max_abs_logit_diff:.3g})"]
        if self.scope == "layers":
            lines = [f"function-preserving: {verdict} (max |dy| = {self.max_abs_logit_diff:.3g} over the MoE layers, "
                     f"each against its dense FFN; the model, or a forward at its input size, is too large to compare "
                     f"whole)"]
        if self.max_abs_logit == 0:
            lines = ["function-preserving: cannot tell (the dense logits are all 0, e.g. a zero-initialized head; "
                     "upcycle trained weights to check)"]
        fresh = [c for c in self.caveats if "freshly initialized" in c]
        if not self.function_preserving:
            lines += [f"  because {caveat}" for caveat in self.caveats if caveat not in fresh]
        lines += [f"  {caveat}" for caveat in fresh]  # always said, block by block
        return "\n".join(lines)


def caveats(plan: Plan) -> tuple[str, ...]:
    """Why an upcycled model of `plan` may not compute the dense function, one line per surgery group and
    one per rebuilt block. The router kind says what its routing changes."""
    found: dict[str, None] = {}
    for r in plan.rescales:
        found[f"{r.block}: rebuilt at [{r.rescaled_tokens}, {r.rescaled_channels}] (rescale.{r.group}) and freshly "
              f"initialized; a block of a new shape cannot be upcycled"] = None
    for layer in plan.layers:
        if plan.rebuilt(layer.path) is not None:
            continue
        where = f"moe.{layer.group}"
        lines = [f"{layer.shared_experts} shared expert(s) add another copy of the dense FFN's output"
                 ] if layer.shared_experts else []
        lines += layer.router.caveats(layer)
        if layer.expert_hidden < layer.dense_hidden:
            lines.append(f"experts keep {layer.expert_hidden} of the dense FFN's {layer.dense_hidden} hidden units")
        if layer.family == "GlobalResponseNormMlp" and layer.router.picks() < layer.num_experts:
            lines.append("each GRN expert normalizes over only the positions it receives")
        found.update((f"{where}: {line}", None) for line in lines)
    return tuple(found)


def upcycle(spec: Spec, checkpoint: Checkpoints = None, *, images: ImageSet | Sequence[ImageSet] | None = None,
            seed: int = 0, trust_pickle: bool = False) -> nn.Module:
    """The MoE model of `spec` with every expert copied from a dense FFN: from one checkpoint (see `dense_model`
    for sources), or from several (`[a, b, ...]`: expert i from source `experts_from[i]`, by default i mod n;
    see `sources.py`). `images` start the routers of `router_init: hidden` (one folder or batch per source) or
    `kmeans` (one or more); see `router_start.py`."""
    model, _ = upcycle_with_report(spec, checkpoint, images=images, seed=seed, check=False, trust_pickle=trust_pickle)
    return model


def upcycle_with_report(spec: Spec, checkpoint: Checkpoints = None, *,
                        images: ImageSet | Sequence[ImageSet] | None = None, seed: int = 0, check: bool = True,
                        trust_pickle: bool = False, on_batch: Callable[[str, int, int], None] | None = None,
                        on_skip: Callable[[str], None] | None = None) -> tuple[nn.Module, UpcycleReport | None]:
    """`upcycle`, plus a comparison of the upcycled model's logits with the base dense model's and each
    source's, on the images given (or random inputs). `on_batch(item, done, total)` follows the image pass;
    `on_skip(line)` hears of the unreadable files it skipped (`router_start.router_rows`)."""
    sources, plan, sets = read_start(spec, checkpoint, images, seed=seed, trust_pickle=trust_pickle)
    generator = torch.Generator().manual_seed(seed)
    model = create_model(spec)
    layers = moe_layers(model)
    start = start_routers(spec, plan, sources, layers, sets, seed=seed, on_batch=on_batch, on_skip=on_skip)
    upcycle_into(model, spec, plan, sources, generator, start)
    if not check:
        return model, None
    refuse_costly_forward(spec, plan.input_size, "checking the upcycled logits",
                          batch=COMPARED_IMAGES if sets else COMPARED_BATCH, runner="a check",
                          hint="use a smaller input size, or check=False")
    x = compared_inputs(sets, plan, sources.base, spec)
    x = torch.randn((COMPARED_BATCH, *plan.input_size), generator=generator) if x is None else x
    report = compare(sources.base, model, plan.input_size, sources.names[0] if sources.count == 1 else
                     sources.base_label(), generator, inputs=x)
    errors = source_errors(model, spec, sources, x, seed=seed, trust_pickle=trust_pickle)
    fields = start.report_fields(spec, sources, errors, compared_on(sets, x))
    return model.train(), dataclasses.replace(report, caveats=caveats(plan) + start.caveats(spec, plan), **fields)


@dataclass(frozen=True)
class RouterStart:
    """Where each layer's experts come from and how its router starts, decided before any layer is filled."""

    experts_from: dict[str, tuple[int, ...]]  # MoE layer path -> each routed expert's source
    rows: dict[str, torch.Tensor]  # MoE layer path -> [E, C] rows from data (router_init: hidden | kmeans)
    router: str  # how the routers start, in words

    def caveats(self, spec: Spec, plan: Plan) -> tuple[str, ...]:
        """Why the start is not the dense function beyond what `caveats(plan)` says: experts of several sources,
        Drop-Upcycling's redrawn units."""
        found: dict[str, None] = {}
        for path, experts in self.experts_from.items():
            group = f"moe.{plan.layer(path).group}"
            if len(set(experts)) > 1:
                found[f"{group}: its experts come from {len(set(experts))} sources, whose FFNs differ"] = None
            if spec.upcycle.drop:
                found[f"{group}: drop: {spec.upcycle.drop:g} re-initializes that share of each expert's hidden "
                      f"units"] = None
        return tuple(found)

    def report_fields(self, spec: Spec, sources: Sources, errors: tuple[float, ...], on: str) -> dict:
        """The report's account of the start (`UpcycleReport.start_lines`)."""
        return {"sources": sources.names, "base": sources.base_label(), "source_errors": errors,
                "compared_on": on, "drop": spec.upcycle.drop,
                "starts": tuple(LayerStart(path, experts, self.router) for path, experts in self.experts_from.items())}


def read_start(spec: Spec, checkpoint: Checkpoints, images, *, seed: int, trust_pickle: bool
               ) -> tuple[Sources, Plan, list[ImageSet]]:
    """The sources read and checked, the plan, and the image sets checked against `router_init`."""
    sources, plan = read_sources(spec, checkpoint, seed=seed, trust_pickle=trust_pickle)
    check_items(spec, plan, sources.base)
    sets = image_sets(images)
    check_image_sets(spec, sets, sources.count)
    return sources, plan, sets


def start_routers(spec: Spec, plan: Plan, sources: Sources, layers: dict[str, MoELayer], sets: list[ImageSet], *,
                  seed: int, on_batch: Callable[[str, int, int], None] | None = None,
                  on_skip: Callable[[str], None] | None = None) -> RouterStart:
    """Each layer's expert sources, and its router rows where `router_init` starts them from `sets`."""
    experts_from = {layer.path: expert_sources(spec, layer, sources.count) for layer in plan.layers
                    if plan.rebuilt(layer.path) is None}
    rows, read = {}, []
    if spec.upcycle.router_init in ("hidden", "kmeans"):
        rows, read = router_rows(spec, plan, sources.base, layers, sets, experts_from, seed + 2, on_batch, on_skip)
    return RouterStart(experts_from, rows, describe_start(spec, read))


@torch.no_grad()
def check_items(spec: Spec, plan: Plan, dense: nn.Module) -> None:
    """Each router's checks against the items per image its FFN receives (Soft MoE's identity routing needs one
    slot per token), from one forward of the dense model at batch 1: a located spec error before anything is
    built or written. FFNs of blocks that `rescale` rebuilds are not in the dense model and are not checked."""
    checked = [layer for layer in plan.layers if plan.rebuilt(layer.path) is None
               and type(layer.router).check_items is not RouterSpec.check_items]  # only routers that check
    if not checked:
        return
    refuse_costly_forward(spec, plan.input_size, "checking the items each router receives")
    items: dict[str, int] = {}

    def record(layer: LayerPlan, module: nn.Module, args: tuple) -> None:
        x = args[0]
        items[layer.path] = x.numel() // x.shape[layer.channels_dim]

    hooks = [dense.get_submodule(layer.path).register_forward_pre_hook(
        lambda module, args, layer=layer: record(layer, module, args)) for layer in checked]
    training = dense.training
    try:
        dense.eval()(torch.zeros(1, *plan.input_size))
    finally:
        dense.train(training)
        for hook in hooks:
            hook.remove()
    problems = items_problems(spec, plan.layers, items)
    if problems:
        raise SpecError(problems)


def upcycle_into(model: nn.Module, spec: Spec, plan: Plan, sources: Sources, generator: torch.Generator,
                 start: RouterStart) -> None:
    """Copy the sources into the compiled `model` in place: the base's non-FFN weights as they are, each
    layer's FFNs into its experts (`upcycle_layer`). Blocks rebuilt at a rescaled shape keep their fresh init:
    no dense weight has their shape."""
    plain, _ = dense_to_moe(plan, sources.base.state_dict())
    layers = moe_layers(model)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name in plain:
                tensor.copy_(plain[name])
        for path, experts_from in start.experts_from.items():
            upcycle_layer(layers[path], plan.layer(path), [ffns[path] for ffns in sources.ffns], spec, generator,
                          experts_from=experts_from, base_ffn=sources.base_ffns[path], rows=start.rows.get(path))


def upcycle_layer(moe: nn.Module, layer: LayerPlan, ffns: Sequence[dict[str, torch.Tensor]], spec: Spec,
                  generator: torch.Generator, *, experts_from: Sequence[int] | None = None,
                  base_ffn: dict[str, torch.Tensor] | None = None, rows: torch.Tensor | None = None) -> None:
    """Fill one MoE layer: routed expert i from the FFN state `ffns[experts_from[i]]` (default: one source, or
    i mod the sources), shared experts, `pre` and bank buffers from `base_ffn` (default: `ffns[0]`), then the
    router: drawn N(0, 0.02^2) (also under `hidden` / `kmeans`, which then point the rows along `rows`, so that
    the generator advances alike) or zero."""
    options = spec.upcycle
    hidden = layer.expert_hidden
    base_ffn = ffns[0] if base_ffn is None else base_ffn
    experts_from = experts_from or [i % len(ffns) for i in range(layer.num_experts)]
    if hidden > layer.dense_hidden:
        width = "expert_hidden" if spec.moe[layer.group].expert_hidden is not None else "expert_mlp_ratio"
        raise SpecError(spec_problem(
            spec, f"moe.{layer.group}.{width}",
            f"{layer.path}: experts of {hidden} hidden units cannot be upcycled from a dense FFN of "
            f"{layer.dense_hidden}; use an expert width <= {layer.dense_hidden}"))
    if options.split == "partition" and hidden * layer.num_experts > layer.dense_hidden:
        raise SpecError(spec_problem(
            spec, "upcycle.split",
            f"{layer.path}: split: partition needs experts x expert_hidden <= {layer.dense_hidden} "
            f"(got {layer.num_experts} x {hidden}); use split: slice or narrower experts"))
    if layer.whole_ffn and options.drop > 0:
        raise SpecError(spec_problem(
            spec, "upcycle.drop", f"{layer.path}: its experts are whole copies of an FFN that mixes positions, and "
                                  f"Drop-Upcycling re-initializes hidden units of per-position experts only; leave "
                                  f"upcycle.drop out"))
    if layer.whole_ffn:  # whole copies of the FFN: each one its source's state dict (buffers too)
        for copy, source in zip(moe.experts.copies, experts_from, strict=True):
            copy_ffn(copy, ffns[source], options.noise, generator)
        for copy in moe.shared.copies if moe.shared is not None else ():
            copy_ffn(copy, base_ffn, options.noise, generator)
    else:
        fill_banks(moe, layer, ffns, experts_from, base_ffn, options, generator)
    for weight in moe.router_weights():
        if options.router_init == "zeros":
            weight.zero_()
        else:
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.02)
    if rows is not None:
        moe.gate_router().point_at(rows)


COMPARED_BATCH = 2  # random inputs the logit check runs through both models
COMPARED_IMAGES = 16  # given images the logit checks run, at most


def compared_inputs(sets: list[ImageSet], plan: Plan, base: nn.Module, spec: Spec) -> torch.Tensor | None:
    """The first `COMPARED_IMAGES` images of the sets (set after set), or None for random inputs."""
    taken: list[torch.Tensor] = []
    for index, images in enumerate(sets):
        for batch in Batches(images, index, base, spec, plan.input_size):
            taken.append(batch[:COMPARED_IMAGES - sum(t.shape[0] for t in taken)])
            if sum(t.shape[0] for t in taken) >= COMPARED_IMAGES:
                return torch.cat(taken)
            break  # the first batch of each set
    return torch.cat(taken) if taken else None


def compared_on(sets: list[ImageSet], x: torch.Tensor | None) -> str:
    if x is None or not sets:
        return f"{COMPARED_BATCH} random inputs"
    return f"{x.shape[0]} of the images given"


@torch.no_grad()
def source_errors(model: nn.Module, spec: Spec, sources: Sources, x: torch.Tensor, *, seed: int,
                  trust_pickle: bool) -> tuple[float, ...]:
    """||MoE logits - source i's dense logits|| / ||source i's dense logits|| on `x`, per source: how far the
    start is from each source's function. Each source is read again, one at a time (source 0 is the base under
    `base: first`)."""
    moe_logits = model.eval()(x)
    errors = []
    for index, checkpoint in enumerate(sources.checkpoints):
        if index == 0 and (sources.base_mode == "first" or sources.count == 1):
            dense = sources.base
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                dense, _ = dense_model(spec, checkpoint, trust_pickle=trust_pickle)
        logits = dense.eval()(x)
        errors.append(((moe_logits - logits).norm() / logits.norm().clamp(min=1e-30)).item())
        del dense
    return tuple(errors)


@torch.no_grad()
def compare(dense: nn.Module, model: nn.Module, input_size: tuple[int, int, int], source: str,
            generator: torch.Generator, batch: int = COMPARED_BATCH, inputs: torch.Tensor | None = None
            ) -> UpcycleReport:
    """Max |logit difference| between the dense and the MoE model on `inputs` (default: one random batch drawn
    from `generator`), in eval mode."""
    x = torch.randn((batch, *input_size), generator=generator) if inputs is None else inputs
    dense_logits = dense.eval()(x)
    moe_logits = model.eval()(x)
    diff = (dense_logits - moe_logits).abs().max().item()
    return UpcycleReport(source, diff, dense_logits.abs().max().item())

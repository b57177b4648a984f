"""Sparse upcycling (Komatsuzaki et al. 2023): start an MoE model from a dense one.

Every non-FFN weight is copied from the dense state dict; each expert (and shared expert) is a copy of the
dense FFN, or of a subset of its hidden units when experts are narrower (`split: slice` gives every expert
the leading units, `split: partition` gives expert i the i-th block); routers start N(0, 0.02^2) or zero.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import fx, nn

from .adapters import adapter_named
from .backbone import create_backbone
from .checkpoint import check_state_dict, read_state_dict
from .compile import create_model, moe_layers
from .layers import SoftMoE
from .errors import SpecError
from .plan import LayerPlan, Plan, checkpoint_problem
from .spec import Spec, spec_problem


@dataclass(frozen=True)
class UpcycleReport:
    """How closely the upcycled model computes the dense function at initialization."""

    source: str  # where the dense weights came from
    max_abs_logit_diff: float
    max_abs_logit: float
    caveats: tuple[str, ...] = ()  # what in the spec changes the function, from `caveats(plan)`

    @property
    def function_preserving(self) -> bool:
        """Equal to the dense model up to fp32 rounding (1e-5, relative to the logit scale when it is > 1)."""
        return self.max_abs_logit_diff <= 1e-5 * max(1.0, self.max_abs_logit)

    def __str__(self) -> str:
        verdict = "yes" if self.function_preserving else "no"
        lines = [f"function-preserving: {verdict} (max |dlogit| = {self.max_abs_logit_diff:.3g})"]
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
    one per rebuilt block."""
    found: dict[str, None] = {}
    for r in plan.rescales:
        found[f"{r.block}: rebuilt at [{r.rescaled_tokens}, {r.rescaled_channels}] (rescale.{r.group}) and freshly "
              f"initialized; a block of a new shape cannot be upcycled"] = None
    for layer in plan.layers:
        if plan.rebuilt(layer.path) is not None:
            continue
        r, where = layer.router, f"moe.{layer.group}"
        if layer.shared_experts:
            found[f"{where}: {layer.shared_experts} shared expert(s) add another copy of the dense FFN's output"] = None
        if r.kind == "soft":
            found[f"{where}: Soft MoE feeds experts convex mixtures of all tokens, not each token itself"] = None
        if r.kind in ("topk", "image") and not r.normalize and layer.top_k < layer.experts:
            found[f"{where}: the top-{layer.top_k} gates are not renormalized (normalize: false), so the FFN "
                  f"output is scaled by the kept gate mass"] = None
        if r.kind == "expert_choice":
            found[f"{where}: with expert choice a token may be taken by several experts or by none"] = None
        if layer.capacity_factor is not None or (r.kind == "topk" and r.drop_fraction > 0):
            found[f"{where}: tokens dropped by the capacity factor or importance-score routing get no FFN output"] = None
        if layer.expert_hidden < layer.dense_hidden:
            found[f"{where}: experts keep {layer.expert_hidden} of the dense FFN's {layer.dense_hidden} hidden units"] = None
        if layer.family == "GlobalResponseNormMlp" and layer.top_k < layer.experts:
            found[f"{where}: each GRN expert normalizes over only the positions it receives"] = None
    return tuple(found)


def dense_model(spec: Spec, checkpoint: str | Path | None = None) -> tuple[nn.Module, str]:
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
        state = read_state_dict(checkpoint)
        check_state_dict(state, dense, f"checkpoint {checkpoint}")
        dense.load_state_dict(state)
        return dense, str(checkpoint)
    if spec.backbone.pretrained:
        return create_backbone(spec, pretrained=True), f"timm pretrained {spec.backbone.model}"
    return create_backbone(spec), f"fresh {spec.backbone.model} (random init)"


def upcycle(spec: Spec, checkpoint: str | Path | None = None, *, seed: int = 0) -> fx.GraphModule:
    """The MoE model of `spec` with every expert copied from the dense FFN (see `dense_model` for sources)."""
    model, _ = upcycle_with_report(spec, checkpoint, seed=seed, check=False)
    return model


def upcycle_with_report(spec: Spec, checkpoint: str | Path | None = None, *, seed: int = 0,
                        check: bool = True) -> tuple[fx.GraphModule, UpcycleReport | None]:
    """`upcycle`, plus a comparison of the upcycled model's logits with the dense model's on random input."""
    dense, source = dense_model(spec, checkpoint)
    generator = torch.Generator().manual_seed(seed)
    model = create_model(spec)
    upcycle_into(model, model.moespec_plan, dense.state_dict(), generator)
    if not check:
        return model, None
    report = compare(dense, model, model.moespec_plan.input_size, source, generator)
    return model, dataclasses.replace(report, caveats=caveats(model.moespec_plan))


def upcycle_into(model: nn.Module, plan: Plan, dense: dict[str, torch.Tensor], generator: torch.Generator) -> None:
    """Copy `dense` into the compiled `model` in place: non-FFN weights as they are, FFNs into experts.
    Blocks rebuilt at a rescaled shape keep their fresh init: no dense weight has their shape."""
    layers = moe_layers(model)
    skip = tuple(f"{path}." for path in layers) + tuple(f"{r.block}." for r in plan.rescales)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if not name.startswith(skip) and name in dense:
                tensor.copy_(dense[name])
        for layer in plan.layers:
            if plan.rebuilt(layer.path) is not None:
                continue
            ffn_state = {k[len(layer.path) + 1:]: v for k, v in dense.items() if k.startswith(layer.path + ".")}
            _upcycle_layer(layers[layer.path], layer, ffn_state, plan.spec, generator)


def _upcycle_layer(moe: nn.Module, layer: LayerPlan, ffn_state: dict[str, torch.Tensor], spec: Spec,
                   generator: torch.Generator) -> None:
    options = spec.upcycle
    hidden = layer.expert_hidden
    if hidden > layer.dense_hidden:
        width = "expert_hidden" if spec.moe[layer.group].expert_hidden is not None else "expert_mlp_ratio"
        raise SpecError(spec_problem(
            spec, f"moe.{layer.group}.{width}",
            f"{layer.path}: experts of {hidden} hidden units cannot be upcycled from a dense FFN of "
            f"{layer.dense_hidden}; use an expert width <= {layer.dense_hidden}"))
    if options.split == "partition" and hidden * layer.experts > layer.dense_hidden:
        raise SpecError(spec_problem(
            spec, "upcycle.split",
            f"{layer.path}: split: partition needs experts x expert_hidden <= {layer.dense_hidden} "
            f"(got {layer.experts} x {hidden}); use split: slice or narrower experts"))
    adapter = adapter_named(layer.family)
    leading = torch.arange(hidden)
    units = [leading + (i * hidden if options.split == "partition" else 0) for i in range(layer.experts)]
    _fill(moe.experts, [adapter.expert_state(ffn_state, u) for u in units], options.noise, generator)
    if moe.shared is not None:
        _fill(moe.shared, [adapter.expert_state(ffn_state, leading)] * layer.shared_experts, options.noise, generator)
    router = [moe.phi] if isinstance(moe, SoftMoE) else list(moe.router.parameters())
    for weight in router:
        if options.router_init == "zeros":
            weight.zero_()
        else:
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.02)


def _fill(bank: nn.Module, experts: list[dict[str, torch.Tensor]], noise: float, generator: torch.Generator) -> None:
    """Stack per-expert tensors into the bank's [E, ...] parameters, adding N(0, noise^2) to the weights."""
    params = dict(bank.named_parameters())
    for name, param in params.items():
        stacked = torch.stack([expert[name].reshape(param.shape[1:]) for expert in experts])
        if noise > 0 and name.endswith("weight") and name.startswith("fc"):
            stacked = stacked + noise * torch.randn(stacked.shape, generator=generator)
        param.copy_(stacked)


@torch.no_grad()
def compare(dense: nn.Module, model: nn.Module, input_size: tuple[int, int, int], source: str,
            generator: torch.Generator, batch: int = 2) -> UpcycleReport:
    """Max |logit difference| between the dense and the MoE model on one random batch, in eval mode."""
    x = torch.randn((batch, *input_size), generator=generator)
    dense_logits = dense.eval()(x)
    moe_logits = model.eval()(x)
    diff = (dense_logits - moe_logits).abs().max().item()
    return UpcycleReport(source, diff, dense_logits.abs().max().item())

"""Sparse upcycling (Komatsuzaki et al. 2023): start an MoE model from a dense one.

Every non-FFN weight is copied from the dense state dict; each expert (and shared expert) is a copy of the
dense FFN, or of a subset of its hidden units when experts are narrower (`split: slice` gives every expert
the leading units, `split: partition` gives expert i the i-th block); routers start N(0, 0.02^2) or zero.

Two ways, the same weights for the same seed:
    upcycle / upcycle_with_report   the whole MoE model in memory (to train it right away)
    upcycle_to_checkpoint           streams to (sharded) safetensors: the dense model plus one MoE layer at a
                                    time are in memory, never the whole MoE model (`moespec upcycle`)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import fx, nn

from .adapters import adapter_named
from .backbone import create_backbone
from .build import materialize
from .checkpoint import (DEFAULT_MAX_SHARD_SIZE, CheckpointError, TensorInfo, check_state_dict, load, output_dtype,
                         read_safetensors_into, read_state_dict, safetensors_shapes, spec_metadata, write_sharded)
from .compile import compile_model, create_model, moe_layers
from .errors import SpecError
from .layers import SoftMoE
from .plan import LayerPlan, Plan, checkpoint_problem, plan_for
from .spec import Spec, spec_problem


@dataclass(frozen=True)
class UpcycleReport:
    """How closely the upcycled model computes the dense function at initialization."""

    source: str  # where the dense weights came from
    max_abs_logit_diff: float
    max_abs_logit: float
    caveats: tuple[str, ...] = ()  # what in the spec changes the function, from `caveats(plan)`
    scope: str = "model"  # "model": logits of the whole model; "layers": each MoE layer against its dense FFN

    @property
    def function_preserving(self) -> bool:
        """Equal to the dense model up to fp32 rounding (1e-5, relative to the logit scale when it is > 1)."""
        return self.max_abs_logit_diff <= 1e-5 * max(1.0, self.max_abs_logit)

    def __str__(self) -> str:
        verdict = "yes" if self.function_preserving else "no"
        lines = [f"function-preserving: {verdict} (max |dlogit| = {self.max_abs_logit_diff:.3g})"]
        if self.scope == "layers":
            lines = [f"function-preserving: {verdict} (max |dy| = {self.max_abs_logit_diff:.3g} over the MoE layers, "
                     f"each against its dense FFN; the model is too large to compare whole)"]
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


def upcycle(spec: Spec, checkpoint: str | Path | None = None, *, seed: int = 0,
            trust_pickle: bool = False) -> fx.GraphModule:
    """The MoE model of `spec` with every expert copied from the dense FFN (see `dense_model` for sources)."""
    model, _ = upcycle_with_report(spec, checkpoint, seed=seed, check=False, trust_pickle=trust_pickle)
    return model


def upcycle_with_report(spec: Spec, checkpoint: str | Path | None = None, *, seed: int = 0,
                        check: bool = True, trust_pickle: bool = False) -> tuple[fx.GraphModule, UpcycleReport | None]:
    """`upcycle`, plus a comparison of the upcycled model's logits with the dense model's on random input."""
    dense, source = dense_model(spec, checkpoint, trust_pickle=trust_pickle)
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
    _fill(moe.experts, [lambda u=u: adapter.expert_state(ffn_state, u) for u in units], options.noise, generator)
    if moe.shared is not None:
        shared = [lambda: adapter.expert_state(ffn_state, leading)] * layer.shared_experts
        _fill(moe.shared, shared, options.noise, generator)
    router = [moe.phi] if isinstance(moe, SoftMoE) else list(moe.router.parameters())
    for weight in router:
        if options.router_init == "zeros":
            weight.zero_()
        else:
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.02)


def _fill(bank: nn.Module, experts: list[Callable[[], dict[str, torch.Tensor]]], noise: float,
          generator: torch.Generator) -> None:
    """Copy each expert's tensors (made by `experts[i]()`, one expert at a time: a layer of a giant spec is
    large) into the bank's [E, ...] parameters, adding N(0, noise^2) to the fc weights."""
    params = dict(bank.named_parameters())
    for i, make in enumerate(experts):
        for name, tensor in make().items():
            param = params[name]
            param[i].copy_(tensor.reshape(param.shape[1:]))
            if noise > 0 and name.endswith("weight") and name.startswith("fc"):
                param[i].add_(torch.randn(param.shape[1:], generator=generator), alpha=noise)


@torch.no_grad()
def compare(dense: nn.Module, model: nn.Module, input_size: tuple[int, int, int], source: str,
            generator: torch.Generator, batch: int = 2) -> UpcycleReport:
    """Max |logit difference| between the dense and the MoE model on one random batch, in eval mode."""
    x = torch.randn((batch, *input_size), generator=generator)
    dense_logits = dense.eval()(x)
    moe_logits = model.eval()(x)
    diff = (dense_logits - moe_logits).abs().max().item()
    return UpcycleReport(source, diff, dense_logits.abs().max().item())


def upcycle_to_checkpoint(spec: Spec, output: str | Path, *, checkpoint: str | Path | None = None, seed: int = 0,
                          dtype: torch.dtype | None = None, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                          force: bool = False, check: bool = True, trust_pickle: bool = False,
                          on_layer: Callable[[str, int, int], None] | None = None) -> tuple[list[Path], UpcycleReport | None]:
    """Upcycle `spec` straight into a (sharded) safetensors checkpoint at `output`, streaming.

    The MoE layers are built on the meta device; while the shards are written, each layer is materialized,
    filled from the dense FFN, written and freed, so peak memory is the dense model plus one MoE layer.
    Weights equal `upcycle(spec, checkpoint, seed=seed)`'s (cast to `dtype`). The check compares the logits
    of the written model, loaded back, with the dense model's (dense weights rounded to `dtype` too) when
    the MoE model takes at most a quarter of this machine's memory, else each MoE layer against its dense
    FFN as it is built. `on_layer(path, done, total)` is called after each MoE layer is written.
    Returns the files written (index first) and the check's report (None without `check`).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # fresh inits (dense model without weights, rebuilt blocks) are reproducible
        generator = torch.Generator().manual_seed(seed)
        dense, source = dense_model(spec, checkpoint, trust_pickle=trust_pickle)
        plan = plan_for(spec, dense)
        dense_state = dense.state_dict()  # keeps the FFN weights reachable once the MoE model replaces them
        model = compile_model(dense, plan, moe_device="meta")  # shares every other module with `dense`
        state = model.state_dict()
        params = sum(t.numel() for t in state.values())
        whole = check and params * 4 <= _memory_bytes() / 4
        layers = _LayerStream(model, plan, dense, dense_state, generator, per_layer_check=check and not whole,
                              on_layer=on_layer)
        infos = [TensorInfo(name, tuple(t.shape), output_dtype(t.dtype, dtype)) for name, t in state.items()]
        files = write_sharded(output, infos, lambda info: layers.tensor(info.name, state).to(info.dtype),
                              spec_metadata(spec), max_shard_size=max_shard_size, force=force)
    if not check:
        return files, None
    if whole:
        if dtype is not None:  # compare like with like: the dense weights rounded as the experts were
            dense.to(dtype).float()
        report = compare(dense, load(output), plan.input_size, source, torch.Generator().manual_seed(seed + 1))
    else:
        report = UpcycleReport(source, layers.max_diff, layers.max_output, scope="layers")
    return files, dataclasses.replace(report, caveats=caveats(plan))


class _LayerStream:
    """Hands out the tensors of a model whose MoE layers are on the meta device: each layer is materialized
    and upcycled when its first tensor is asked for, and freed after its last."""

    def __init__(self, model: nn.Module, plan: Plan, dense: nn.Module, dense_state: dict[str, torch.Tensor],
                 generator: torch.Generator, *, per_layer_check: bool,
                 on_layer: Callable[[str, int, int], None] | None):
        self.layers, self.plan, self.dense, self.dense_state = moe_layers(model), plan, dense, dense_state
        self.generator, self.per_layer_check, self.on_layer = generator, per_layer_check, on_layer
        self.check_generator = torch.Generator().manual_seed(generator.initial_seed() + 1)
        self.current: tuple[str, dict[str, torch.Tensor]] | None = None
        self.done = 0
        self.max_diff = self.max_output = 0.0
        names = list(model.state_dict())
        self.owner = {name: path for name in names for path in self.layers if name.startswith(path + ".")}
        self.last = {path: name for name, path in self.owner.items()}  # state-dict order: a layer's names are contiguous

    def tensor(self, name: str, state: dict[str, torch.Tensor]) -> torch.Tensor:
        path = self.owner.get(name)
        if path is None:
            return state[name]
        if self.current is None or self.current[0] != path:
            self.current = (path, self._build(path))
        tensor = self.current[1][name[len(path) + 1:]]
        if name == self.last[path]:
            self.layers[path].to_empty(device="meta")  # free it: the next layer reuses the memory
            self.current = None
            self.done += 1
            if self.on_layer is not None:
                self.on_layer(path, self.done, len(self.layers))
        return tensor

    def _build(self, path: str) -> dict[str, torch.Tensor]:
        layer = materialize(self.layers[path])  # fresh init: what rebuilt (rescaled) blocks keep
        if self.plan.rebuilt(path) is None:
            ffn_state = {k[len(path) + 1:]: v for k, v in self.dense_state.items() if k.startswith(path + ".")}
            with torch.no_grad():
                _upcycle_layer(layer, self.plan.layer(path), ffn_state, self.plan.spec, self.generator)
            if self.per_layer_check:
                self._check(self.dense.get_submodule(path), layer)
        return layer.state_dict()

    @torch.no_grad()
    def _check(self, ffn: nn.Module, layer: nn.Module) -> None:
        """Max |MoE layer - dense FFN| on random items: [2, 16, C] tokens, or a [2, C, 4, 4] map."""
        dim = layer.experts.in_features
        shape = (2, dim, 4, 4) if layer.channels_dim == 1 else (2, 16, dim)
        x = torch.randn(shape, generator=self.check_generator)
        dense_y, moe_y = ffn.eval()(x), layer.eval()(x)
        self.max_diff = max(self.max_diff, (dense_y - moe_y).abs().max().item())
        self.max_output = max(self.max_output, dense_y.abs().max().item())


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

"""Plan before you cut: which FFN call sites become MoE layers, at which widths.

`plan(spec)` reads the backbone's sketch (its blocks and FFN shapes as plain data: from the cache, or from
the backbone built on the meta device, without weights), resolves every surgery group's selector and
widths, and returns a frozen `Plan`. The compiler and the upcycler only read the Plan; `moespec plan`
prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import Problem, SpecError, did_you_mean
from ..spec import (
    BackboneSketch,
    Block,
    BlockLayout,
    FFNShape,
    MoEGroup,
    RouterSpec,
    Spec,
    load_spec,
    located,
    spec_problem,
)
from ..spec.selectors import SelectorError, resolve_where
from .cache import backbone_facts
from .checks import checkpoint_problem, input_size_of, model_name_problems


@dataclass(frozen=True)
class LayerPlan:
    """One FFN call site that becomes an MoE layer: numbers, names and its typed router spec."""

    path: str  # qualified name of the dense FFN, kept by the MoE layer (e.g. "blocks.1.mlp")
    group: int  # index of the surgery group in spec.moe
    block: int  # global block index
    family: str  # FFN family (adapter name), e.g. "Mlp"
    in_features: int
    dense_hidden: int
    expert_hidden: int
    out_features: int
    channels_dim: int  # -1: features last; 1: [B, C, H, W]
    num_experts: int  # routed experts E
    shared_experts: int
    router: RouterSpec = field(hash=False)  # the spec's `router:`, model-dependent defaults filled in (`resolve`)
    aux_loss_weights: dict = field(default_factory=dict, hash=False)  # aux-loss kind -> summed weight
    aux_loss_in_backward: bool = False  # the aux loss reaches the gradients without `moespec.aux_loss`
    aux_loss_backward_scale: float = 1.0  # ... times the loop's loss factor (1/N with N accumulation steps)
    whole_ffn: bool = False  # the experts are whole copies of an FFN that mixes positions (image routing only)


@dataclass(frozen=True)
class RescalePlan:
    """One block rebuilt at a rescaled shape, between a pro-token and a pro-channel rescale (Sparse-MLP)."""

    block: str  # qualified name of the block, kept by the rebuilt block
    group: int  # index in spec.rescale
    tokens: int  # S
    channels: int  # C
    rescaled_tokens: int  # S1
    rescaled_channels: int  # C1
    token_hidden: int  # hidden width of the rebuilt block's token-mixing MLP (or its experts)
    channel_hidden: int  # and of its channel-mixing MLP

    def __str__(self) -> str:
        return (f"rescale {self.block}: [{self.tokens}, {self.channels}] -> [{self.rescaled_tokens}, "
                f"{self.rescaled_channels}] (rebuilt, hidden {self.token_hidden} / {self.channel_hidden}) -> "
                f"[{self.tokens}, {self.channels}]")


@dataclass(frozen=True)
class Plan:
    """What the compiler will change in the backbone, in network order: plain data and the frozen router specs."""

    name: str  # the spec's name
    model: str  # the timm model name
    layout: BlockLayout
    layers: tuple[LayerPlan, ...]
    input_size: tuple[int, int, int]
    rescales: tuple[RescalePlan, ...] = ()

    def layer(self, path: str) -> LayerPlan:
        return next(layer for layer in self.layers if layer.path == path)

    def rebuilt(self, path: str) -> RescalePlan | None:
        """The rescale that rebuilds the block containing module `path`, if any."""
        return next((r for r in self.rescales if path == r.block or path.startswith(r.block + ".")), None)

    COLUMNS = ("module", "family", "in", "dense hidden", "expert hidden", "experts", "k", "shared", "router")

    def rows(self) -> list[tuple[str, ...]]:
        """One row of strings per MoE layer, in the order of `COLUMNS`."""
        return [(layer.path, layer.family, str(layer.in_features), str(layer.dense_hidden), str(layer.expert_hidden),
                 str(layer.num_experts), str(layer.router.picks()), str(layer.shared_experts),
                 layer.router.describe(layer)) for layer in self.layers]

    def summary(self) -> str:
        """One line about the backbone, then one per rescaled block."""
        head = f"{self.name}: {self.model}, input {list(self.input_size)}, {self.layout.describe()}"
        return "\n".join([head, *(str(r) for r in self.rescales)])

    def __str__(self) -> str:
        if not self.layers:
            return self.summary() + "\n(no MoE layers)"
        rows = [self.COLUMNS, *self.rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self.COLUMNS))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        return "\n".join([self.summary(), *lines])


def plan(spec: Spec, *, cached: bool = False) -> Plan:
    """The Plan of `spec`, checked against its timm backbone built on the meta device. Pure: no weights.
    `cached`: read the backbone's sketch from the cache of earlier runs when it is there (`planning.cache`).

    Also checks what only this full check of a spec needs: that the backbone takes the input size (one
    forward on the meta device, or its cached outcome) and that `backbone.checkpoint` names a dense
    checkpoint file.
    """
    sketch, input_problem = backbone_facts(spec, cached=cached)
    problems = [p for p in (input_problem, checkpoint_problem(spec)) if p is not None]
    try:
        result = plan_for(spec, sketch)
    except SpecError as error:
        raise SpecError(error.problems + problems) from None
    if problems:
        raise SpecError(problems)
    return result


def plan_file(file: str | Path, *, cached: bool = False) -> Plan:
    """The Plan of the spec file `file` (`moespec validate`): every problem at once, those of its fields and
    of its timm backbone's name together (a bad top_k and a misspelled model in one run)."""
    try:
        spec = load_spec(file)
    except SpecError as error:
        raise SpecError(error.problems + model_name_problems(str(file), error)) from None
    return plan(spec, cached=cached)


def plan_for(spec: Spec, backbone: Any) -> Plan:
    """The Plan of `spec` for an already built dense model (an `nn.Module` on any device) or its sketch."""
    if isinstance(backbone, BackboneSketch):
        sketch = backbone
    else:
        from ..backbones import sketch_of  # timm: a model is in hand, so it is imported already

        try:
            sketch = sketch_of(backbone)
        except SpecError as error:
            raise located(spec, error) from None
    layout = sketch.layout
    problems: list[Problem] = []
    rescaled = _rescales(spec, sketch, problems)  # block path -> (S, C, S1, C1, rescale index)
    hidden: dict[str, int] = {}  # FFN path in a rebuilt block -> its hidden width
    claimed: dict[str, int] = {}  # FFN path -> the group that set it
    layers: dict[str, LayerPlan] = {}
    for index, group in enumerate(spec.moe):
        for block_index in _picked(spec, f"moe.{index}.where", group.where, layout, problems):
            block = layout.blocks[block_index]
            if group.sublayer is not None and group.sublayer not in block.sublayers:
                problems.append(spec_problem(
                    spec, f"moe.{index}.sublayer",
                    f"block {block.path} has no FFN sublayer {group.sublayer!r}; it has: {', '.join(block.sublayers)}"
                    + did_you_mean(group.sublayer, block.sublayers)))
                break
            sublayers = (group.sublayer,) if group.sublayer is not None else _residual_ffns(block, sketch)
            if not sublayers:
                problems.append(spec_problem(
                    spec, f"moe.{index}.sublayer",
                    f"block {block.path} has no FFN whose output is as wide as its input (a residual FFN); name "
                    f"one with sublayer: {', '.join(block.sublayers)}"))
                break
            for sublayer in sublayers:
                path = f"{block.path}.{sublayer}"
                if path in claimed:
                    earlier = claimed[path]
                    what = "an MoE layer" if spec.moe[earlier].experts else "a plain MLP"
                    problems.append(spec_problem(
                        spec, f"moe.{index}.where",
                        f"{path} is already {what} from moe.{earlier}; each FFN can be replaced once"))
                    continue
                claimed[path] = index
                shape = _rescaled_shape(block.path, sublayer, rescaled, sketch)
                if group.experts == 0 and shape is None:
                    problems.append(spec_problem(
                        spec, f"moe.{index}.experts",
                        f"experts: 0 (a plain MLP) is allowed only in blocks rebuilt by rescale; {block.path} is not"))
                    continue
                layer = _layer_plan(spec, index, group, block_index, path, sketch, problems, shape)
                if layer is None:
                    continue
                if shape is not None:
                    hidden[path] = layer.expert_hidden
                if group.experts > 0:
                    layers[path] = layer
    if problems:
        raise SpecError(list(dict.fromkeys(problems)))  # one report per distinct problem
    order = list(sketch.ffns)  # module order
    ordered = tuple(sorted(layers.values(), key=lambda layer: order.index(layer.path)))
    rescales = []
    for path, (tokens, channels, new_tokens, new_channels, index) in rescaled.items():
        block = sketch.rescalable[path]
        token_ffn, channel_ffn = f"{path}.{block.token_sublayer}", f"{path}.{block.channel_sublayer}"
        rescales.append(RescalePlan(
            path, index, tokens, channels, new_tokens, new_channels,
            token_hidden=hidden.get(token_ffn, sketch.ffns[token_ffn].hidden),
            channel_hidden=hidden.get(channel_ffn, sketch.ffns[channel_ffn].hidden)))
    name = spec.name or spec.backbone.model
    return Plan(name, spec.backbone.model, layout, ordered, input_size_of(spec, sketch), tuple(rescales))


def _residual_ffns(block: Block, sketch: BackboneSketch) -> tuple[str, ...]:
    """The FFN sublayers a group without `sublayer` takes in `block`: those whose output is as wide as their
    input, which a residual adds back (not, say, MaxViT's relative-position MLP inside the attention, which
    maps 2 coordinates to the heads' biases)."""
    return tuple(name for name in block.sublayers
                 if (shape := sketch.ffns[f"{block.path}.{name}"]).in_features == shape.out_features)


def _picked(spec: Spec, field: str, where: list, layout: BlockLayout, problems: list[Problem]) -> list[int]:
    """The blocks a `where` selects, or none (with a problem at `field`) when it does not fit the model."""
    try:
        return resolve_where(where, layout)
    except SelectorError as err:
        problems.append(spec_problem(spec, field, str(err)))
        return []


def _rescales(spec: Spec, sketch: BackboneSketch, problems: list[Problem]) -> dict:
    """Resolve `spec.rescale`: block path -> (S, C, S1, C1, rescale index); problems for what does not fit."""
    rescaled: dict[str, tuple[int, int, int, int, int]] = {}
    for index, rescale in enumerate(spec.rescale):
        for block_index in _picked(spec, f"rescale.{index}.where", rescale.where, sketch.layout, problems):
            path = sketch.layout.blocks[block_index].path
            if path not in sketch.rescalable:
                problems.append(spec_problem(
                    spec, f"rescale.{index}.where",
                    f"{path} is a {sketch.block_types[path]}; rescale rebuilds only "
                    f"{', '.join(sketch.rebuilt_types)} blocks (MLP-Mixer)"))
                break
            if path in rescaled:
                problems.append(spec_problem(spec, f"rescale.{index}.where",
                                             f"{path} is already rescaled by rescale.{rescaled[path][4]}; each block "
                                             f"can be rescaled once"))
                continue
            tokens, channels = sketch.rescalable[path].tokens, sketch.rescalable[path].channels
            sizes = {"tokens": (rescale.tokens * tokens, tokens), "channels": (rescale.channels * channels, channels)}
            bad = False
            for axis, (exact, base) in sizes.items():
                if abs(exact - round(exact)) > 1e-6 or round(exact) < 1:
                    problems.append(spec_problem(
                        spec, f"rescale.{index}.{axis}",
                        f"{getattr(rescale, axis)} x {base} {axis} of {path} = {exact:g} is not a whole number; "
                        f"use a multiple of 1/{base}"))
                    bad = True
            if bad:
                break
            rescaled[path] = (tokens, channels, round(sizes["tokens"][0]), round(sizes["channels"][0]), index)
    return rescaled


def _rescaled_shape(block: str, sublayer: str, rescaled: dict, sketch: BackboneSketch) -> FFNShape | None:
    """The shape of FFN `sublayer` of `block` after the block is rebuilt, or None if it is not rebuilt."""
    if block not in rescaled:
        return None
    _, _, tokens, channels, _ = rescaled[block]
    dense = sketch.ffns[f"{block}.{sublayer}"]
    width = tokens if sublayer == sketch.rescalable[block].token_sublayer else channels
    return FFNShape(dense.family, width, dense.hidden, width, dense.channels_dim)


def _layer_plan(spec: Spec, index: int, group: MoEGroup, block: int, path: str, sketch: BackboneSketch,
                problems: list[Problem], shape: FFNShape | None = None) -> LayerPlan | None:
    shape = shape or sketch.ffns[path]
    try:
        router = group.router.resolve(sketch, spec.backbone.model)
    except SpecError as error:
        problems += [spec_problem(spec, f"moe.{index}.router.{p.path}", p.message) for p in error.problems]
        return None
    hidden = shape.hidden
    if group.expert_hidden is not None:
        hidden = group.expert_hidden
    elif group.expert_mlp_ratio is not None:
        exact = group.expert_mlp_ratio * shape.in_features
        hidden = round(exact)
        if abs(exact - hidden) > 1e-6 or hidden < 1:
            problems.append(spec_problem(
                spec, f"moe.{index}.expert_mlp_ratio",
                f"{group.expert_mlp_ratio} x {shape.in_features} (the input width of {path}) = {exact:g} is not a "
                f"whole number of hidden units; use expert_hidden instead"))
            return None
    problem = _whole_ffn_problem(group, path, shape, hidden) if shape.mixes else None
    if problem is not None:
        problems.append(spec_problem(spec, f"moe.{index}.{problem[0]}", problem[1]))
        return None
    return LayerPlan(
        path=path, group=index, block=block, family=shape.family,
        in_features=shape.in_features, dense_hidden=shape.hidden, expert_hidden=hidden,
        out_features=shape.out_features, channels_dim=shape.channels_dim,
        num_experts=group.experts, shared_experts=group.shared_experts, router=router,
        aux_loss_weights=_aux_loss_weights(group),
        aux_loss_in_backward=spec.aux_loss_in_backward,
        aux_loss_backward_scale=spec.aux_loss_backward_scale,
        whole_ffn=bool(shape.mixes),
    )


def _whole_ffn_problem(group: MoEGroup, path: str, shape: FFNShape, hidden: int) -> tuple[str, str] | None:
    """(field, message) where an FFN that mixes positions cannot become the group's MoE layer: only an image-level
    router sends all of an image's positions to the same experts, each a whole copy of the FFN (so at its width)."""
    what = f"{path} ({shape.family}): {shape.mixes}"
    if not group.router.whole_images:
        return ("router", f"{what}, and an expert under {group.router.kind} routing sees only the positions routed "
                          f"to it; route whole images instead, with router: {{kind: image}}")
    if hidden != shape.hidden:
        width = "expert_hidden" if group.expert_hidden is not None else "expert_mlp_ratio"
        return (width, f"{what}, so each expert is a whole copy of it, at its hidden width {shape.hidden}, not "
                       f"{hidden}; leave {width} out")
    return None


def _aux_loss_weights(group: MoEGroup) -> dict[str, float]:
    """Aux-loss kind -> weight, summed over the group's `aux_loss` entries of that kind."""
    weights: dict[str, float] = {}
    for aux in group.aux_loss:
        weights[aux.kind] = weights.get(aux.kind, 0.0) + aux.weight
    return weights

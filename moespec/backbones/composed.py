"""FFNs named by their parts: [pre] -> fc1 -> act -> fc2, or a GLU's act(gate(x)) * up(x) -> fc2. Each
projection is a Linear, a 1x1 Conv2d, or either one followed by a BatchNorm (timm's ConvNorm, LinearNorm,
Conv2dNorm, ConvNormAct), which is folded into it.

Most FFN classes of timm's model files are such a composition, so one is declared in a few lines
(`families.py`):

    @register_adapter(LevitMlp)
    class LevitMlpAdapter(ComposedAdapter):
        family, fc1, fc2, drop = "LevitMlp", "ln1", "ln2", ("drop", None)

- `pre` is a module the FFN applies to its input before fc1 (TinyViT's LayerNorm, FastViT's depthwise conv).
  The MoE layer keeps it dense and shared (`MoELayer.pre`), runs it before routing, and upcycling copies it.
- A BatchNorm after a projection is folded into the projection's weight and bias with its running statistics:
  the expert computes what the dense FFN computes in eval mode, and has no batch statistics of its own.
- A projection that clamps its input and output (Gemma 4's clippable linears) gives its bounds to the bank
  (`Experts.clamp`, constants the same for every expert).
- What cannot be split into experts is refused with the reason (`refusal`): a projection that is not
  pointwise (a 3x3 or depthwise conv mixes neighbouring positions, and an expert sees only the positions
  routed to it), an activation with parameters, a projection with state moespec does not know.
- A plain `nn.Sequential` of the same parts (FasterNet's `mlp`, iFormer's FFN) is found by its structure
  (`SequentialMlpAdapter`).

Parts are addressed by paths relative to the FFN, and an expert's weights are read from the FFN's state dict
alone (upcycling reads a checkpoint, not a module).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..layers import Experts
from ..spec import FFNShape
from .adapters import Adapter, _matrix, register_adapter

CLAMP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")  # a clippable linear's buffers (Gemma 4)
BATCH_NORM_EPS = 1e-5  # torch's BatchNorm default, which every timm ConvNorm / LinearNorm uses; folded with
_LAYERS = (nn.Linear, nn.Conv2d)
_BATCH_NORM = nn.modules.batchnorm._BatchNorm


@dataclass(frozen=True)
class Parts:
    """Where an FFN's parts are, as paths relative to the FFN. A projection is one or more paths: the layer,
    a container of it, and its BatchNorm (`("fc1", "norm1")`)."""

    fc1: tuple[str, ...]  # for a GLU, the gate projection: act(fc1(x)) * up(x)
    fc2: tuple[str, ...]
    act: str = "act"
    up: tuple[str, ...] | None = None
    pre: str | None = None
    drop: tuple[str | None, str | None] = (None, None)  # the Dropout after the activation and after fc2


def _paths(value: str | tuple[str, ...] | None) -> tuple[str, ...] | None:
    return (value,) if isinstance(value, str) else value


class ComposedAdapter(Adapter):
    """An FFN declared by the paths of its parts (class attributes; see the module docstring)."""

    fc1: str | tuple[str, ...] = "fc1"
    up: str | tuple[str, ...] | None = None
    act: str = "act"
    fc2: str | tuple[str, ...] = "fc2"
    pre: str | None = None
    drop: tuple[str | None, str | None] = (None, None)

    def parts(self, ffn: nn.Module) -> Parts:
        return Parts(_paths(self.fc1), _paths(self.fc2), self.act, _paths(self.up), self.pre, self.drop)

    def shape(self, ffn: nn.Module) -> FFNShape:
        parts = self.parts(ffn)
        fc1, _ = _projection(ffn, parts.fc1)
        fc2, _ = _projection(ffn, parts.fc2)
        channels_dim = 1 if isinstance(fc1, nn.Conv2d) else -1
        return FFNShape(self.family, _width(fc1, "in"), _width(fc2, "in"), _width(fc2, "out"), channels_dim)

    def build_experts(self, ffn: nn.Module, num_experts: int, hidden: int) -> Experts:
        s, parts = self.shape(ffn), self.parts(ffn)
        gated = (parts.fc1,) if parts.up is None else (parts.fc1, parts.up)
        biased = (any(_has_bias(*_projection(ffn, paths)) for paths in gated), _has_bias(*_projection(ffn, parts.fc2)))
        drop = [ffn.get_submodule(path).p if path else 0.0 for path in parts.drop]
        clamped = any(_clamps(ffn.get_submodule(path)) for paths in (parts.fc1, parts.up or (), parts.fc2)
                      for path in paths)
        return Experts(num_experts, s.in_features, hidden, s.out_features,
                       act=copy.deepcopy(ffn.get_submodule(parts.act)), glu="act_first" if parts.up else None,
                       bias=biased, drop=tuple(drop), clamped=clamped)

    def refusal(self, ffn: nn.Module) -> str | None:
        parts = self.parts(ffn)
        act = ffn.get_submodule(parts.act)
        if any(True for _ in act.parameters()):
            return f"its activation {parts.act} ({type(act).__name__}) has parameters, which experts do not share"
        for paths in (parts.fc1, parts.up, parts.fc2):
            if paths is not None:
                reason = _projection_refusal(ffn, paths)
                if reason is not None:
                    return reason
        return None

    def expert_state(self, dense: dict[str, torch.Tensor], units: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = self.state_parts(dense)
        fc1_weight, fc1_bias = projection_state(dense, parts.fc1)
        if parts.up is not None:
            up_weight, up_bias = projection_state(dense, parts.up)
            fc1_weight, fc1_bias = torch.cat([fc1_weight[units], up_weight[units]]), _cat(fc1_bias, up_bias, units)
        else:
            fc1_weight, fc1_bias = fc1_weight[units], None if fc1_bias is None else fc1_bias[units]
        fc2_weight, fc2_bias = projection_state(dense, parts.fc2)
        state = {"fc1.weight": fc1_weight, "fc2.weight": fc2_weight[:, units]}
        state.update({name: bias for name, bias in (("fc1.bias", fc1_bias), ("fc2.bias", fc2_bias))
                      if bias is not None})
        return state

    def bank_buffers(self, dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`Experts.clamp` from the clamp bounds of the projections (rows: fc1, up, fc2), where they have any."""
        parts = self.state_parts(dense)
        rows = [_under(dense, paths) for paths in (parts.fc1, parts.up or (), parts.fc2)]
        if not any(name in row for row in rows for name in CLAMP_BOUNDS):
            return {}
        unbounded = torch.tensor([-math.inf, math.inf, -math.inf, math.inf])
        return {"clamp": torch.stack([torch.stack([row[name].float().reshape(()) for name in CLAMP_BOUNDS])
                                      if CLAMP_BOUNDS[0] in row else unbounded for row in rows])}

    def state_parts(self, dense: dict[str, torch.Tensor]) -> Parts:
        """The parts, read from the FFN's state dict alone (the declared paths)."""
        return self.parts(None)

    def pre_module(self, ffn: nn.Module) -> nn.Module | None:
        pre = self.parts(ffn).pre
        return None if pre is None else copy.deepcopy(ffn.get_submodule(pre))

    def pre_state(self, dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pre = self.state_parts(dense).pre
        return {} if pre is None else _under(dense, (pre,))


@register_adapter(nn.Sequential)
class SequentialMlpAdapter(ComposedAdapter):
    """A plain `nn.Sequential` FFN, found by its structure: a projection and an optional BatchNorm, an
    activation between optional Dropouts, a projection and an optional BatchNorm, optional Dropouts (FasterNet's
    `mlp`, iFormer's FFN)."""

    family = "SequentialMlp"
    PATTERN = re.compile(r"(lb?)(d*)a(d*)(lb?)(d*)")  # l: Linear / Conv2d, b: BatchNorm, d: Dropout, a: activation

    def matches(self, module: nn.Module) -> bool:
        return self._parts(module) is not None

    def parts(self, ffn: nn.Sequential) -> Parts:
        return self._parts(ffn)

    def _parts(self, sequential: nn.Sequential) -> Parts | None:
        match = self.PATTERN.fullmatch("".join(_letter(m) for m in sequential))
        if match is None:
            return None

        def span(group: int) -> tuple[str, ...]:
            return tuple(str(i) for i in range(match.start(group), match.end(group)))

        drop1, drop2 = span(3) or span(2), span(5)
        return Parts(span(1), span(4), act=str(match.start(3) - 1), drop=(drop1[-1] if drop1 else None,
                                                                          drop2[0] if drop2 else None))

    def state_parts(self, dense: dict[str, torch.Tensor]) -> Parts:
        """fc1 and fc2 from the tensors' names alone: the layers are the children with a matrix weight, and a
        BatchNorm (running statistics) right after a layer belongs to it."""
        layers, norms = set(), set()
        for name, tensor in dense.items():
            index, _, rest = name.partition(".")
            if rest.endswith("running_mean"):
                norms.add(int(index))
            elif rest.endswith("weight") and tensor.dim() >= 2:
                layers.add(int(index))
        norms -= layers  # a ConvNorm child holds its own BatchNorm
        first, second = sorted(layers)
        projection = [(str(i),) + ((str(i + 1),) if i + 1 in norms else ()) for i in (first, second)]
        return Parts(projection[0], projection[1])


def _letter(module: nn.Module) -> str:
    """The one letter `SequentialMlpAdapter.PATTERN` reads for `module` ("x": none of its kinds)."""
    if isinstance(module, _LAYERS) or _is_projection(module):
        return "l"
    if isinstance(module, _BATCH_NORM):
        return "b"
    if isinstance(module, nn.Dropout):
        return "d"
    return "a" if type(module).__module__.rsplit(".", 1)[-1].startswith("activation") else "x"


def _is_projection(module: nn.Module) -> bool:
    """A container of one Linear / Conv2d and at most one BatchNorm (timm's ConvNorm and its kin)."""
    kinds = [_LAYERS if isinstance(m, _LAYERS) else _BATCH_NORM if isinstance(m, _BATCH_NORM) else None
             for m in module.children()]
    return kinds.count(_LAYERS) == 1 and kinds.count(_BATCH_NORM) <= 1 and None not in kinds


def _projection(ffn: nn.Module, paths: tuple[str, ...]) -> tuple[nn.Module, nn.Module | None]:
    """(the Linear / Conv2d, its BatchNorm or None) of a projection at `paths` of `ffn`."""
    layers, norms = [], []
    for path in paths:
        module = ffn.get_submodule(path)
        for m in (module, *module.children()):
            if isinstance(m, _LAYERS):
                layers.append(m)
            elif isinstance(m, _BATCH_NORM):
                norms.append(m)
            if m is module and isinstance(m, (*_LAYERS, _BATCH_NORM)):
                break
    if len(layers) != 1 or len(norms) > 1:
        raise ValueError(f"{'+'.join(paths)} is not one Linear / Conv2d with an optional BatchNorm")
    return layers[0], norms[0] if norms else None


def _projection_refusal(ffn: nn.Module, paths: tuple[str, ...]) -> str | None:
    """Why the projection at `paths` cannot be an expert's, or None."""
    name = "+".join(paths)
    try:
        layer, norm = _projection(ffn, paths)
    except ValueError as err:
        return str(err)
    if isinstance(layer, nn.Conv2d) and (layer.kernel_size != (1, 1) or layer.groups != 1 or layer.stride != (1, 1)
                                         or layer.padding not in ((0, 0), "valid")):
        return (f"its projection {name} is a {'x'.join(map(str, layer.kernel_size))} conv (groups={layer.groups}), "
                f"which mixes neighbouring positions; an expert sees only the positions routed to it")
    if norm is not None and (norm.eps != BATCH_NORM_EPS or not norm.track_running_stats):
        return (f"its BatchNorm in {name} has eps {norm.eps} or no running statistics; moespec folds BatchNorms "
                f"with eps {BATCH_NORM_EPS} and running statistics into the experts' weights")
    for path in paths:
        module = ffn.get_submodule(path)
        own = [n for n, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
               if n not in CLAMP_BOUNDS]
        if own and not isinstance(module, (*_LAYERS, _BATCH_NORM)):
            return f"its projection {path} ({type(module).__name__}) holds {', '.join(own)}, which experts do not"
    return None


def projection_state(dense: dict[str, torch.Tensor], paths: tuple[str, ...]
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The [out, in] weight and [out] bias (or None) of the projection at `paths` of an FFN's state dict, its
    BatchNorm folded in: W' = W * s, b' = (b - mean) * s + beta with s = gamma / sqrt(var + eps)."""
    tensors = _under(dense, paths, keep_prefix=True)
    norm = next((name[: -len("running_mean")] for name in tensors if name.endswith("running_mean")), None)
    weights = [name for name, t in tensors.items() if name.endswith("weight") and t.dim() >= 2]
    layer = weights[0][: -len("weight")]
    weight, bias = _matrix(tensors[weights[0]]), tensors.get(layer + "bias")
    if norm is None:
        return weight, bias
    var, mean = tensors[norm + "running_var"].float(), tensors[norm + "running_mean"].float()
    scale = torch.rsqrt(var + BATCH_NORM_EPS)
    if norm + "weight" in tensors:
        scale = scale * tensors[norm + "weight"].float()
    shift = -mean * scale if bias is None else (bias.float() - mean) * scale
    if norm + "bias" in tensors:
        shift = shift + tensors[norm + "bias"].float()
    return weight.float() * scale[:, None], shift


def _under(dense: dict[str, torch.Tensor], paths: tuple[str, ...], keep_prefix: bool = False
           ) -> dict[str, torch.Tensor]:
    """The tensors under any of `paths`, named relative to the path (or whole, with `keep_prefix`)."""
    found = {}
    for path in paths:
        for name, tensor in dense.items():
            if name.startswith(path + "."):
                found[name if keep_prefix else name[len(path) + 1:]] = tensor
    return found


def _cat(gate: torch.Tensor | None, up: torch.Tensor | None, units: torch.Tensor) -> torch.Tensor | None:
    if gate is None and up is None:
        return None
    gate = torch.zeros_like(up) if gate is None else gate
    up = torch.zeros_like(gate) if up is None else up
    return torch.cat([gate[units], up[units]])


def _clamps(module: nn.Module) -> bool:
    """Whether the projection `module` clamps its input and output (its own buffers `CLAMP_BOUNDS`)."""
    return all(name in dict(module.named_buffers(recurse=False)) for name in CLAMP_BOUNDS)


def _has_bias(layer: nn.Module, norm: nn.Module | None) -> bool:
    return layer.bias is not None or norm is not None


def _width(layer: nn.Module, side: str) -> int:
    if isinstance(layer, nn.Linear):
        return layer.in_features if side == "in" else layer.out_features
    return layer.in_channels if side == "in" else layer.out_channels

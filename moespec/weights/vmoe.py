"""Google's released V-MoE checkpoints as moespec models (Riquelme et al. 2021, github.com/google-research/vmoe).

    import_vmoe(path, top_k=2, capacity_factor=1.05, group_size=8 * 197)   -> timm VisionTransformer with MoE layers

`path` is a vmoe checkpoint prefix (`PREFIX.index` + `PREFIX.data-*`, `io.vmoe_index`) or an Orbax folder
(`io.orbax`). The architecture is read from the tree's shapes (`VmoeArchitecture`); the routing, which the file
does not hold, is V-MoE's with the options given. The spec is a plain moespec spec: timm's ViT with V-MoE's tanh
GELU (`act_layer: gelu_tanh`) and its representation layer (`backbone.pre_logits`), the MoE blocks as V-MoE placed
them, a `topk` router with vmoe's capacity rounding (`capacity_multiple: 4`), its routing groups and BPR.

Each tensor is read, turned into timm's layout and copied into the model before the next is read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

import numpy as np
import torch
from torch import nn

from ..compiler import create_model
from ..errors import CheckpointError, MoespecError
from ..io.orbax import OrbaxCheckpoint, is_orbax
from ..io.vmoe_index import LegacyCheckpoint
from ..spec import Spec, load_spec

CAPACITY_MULTIPLE = 4
"""vmoe's `_compute_capacity` rounds each expert's capacity per group up to a multiple of 4."""
IMPORTANCE_LOAD_WEIGHT = 0.01
"""V-MoE's losses, 0.005 x importance + 0.005 x load: moespec's importance_load is weight x (importance + load) / 2."""
BLOCK = re.compile(r"Encoder/encoderblock_(\d+)/")
TIMM_VITS = {8: "vit_base_patch8_224", 16: "vit_base_patch16_224", 32: "vit_base_patch32_224"}
"""The timm entry point named in the spec, by patch size (the kwargs give every size; others use patch 16's)."""


class TreeReader(Protocol):
    """What `io.vmoe_index.LegacyCheckpoint` and `io.orbax.OrbaxCheckpoint` give: the tree's shapes, then its arrays."""

    index: Path

    def shapes(self) -> dict[str, tuple[int, ...]]: ...

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]: ...


@dataclass(frozen=True)
class VmoeArchitecture:
    """A V-MoE ViT as its tree's shapes give it."""

    width: int
    depth: int
    heads: int
    mlp: int
    patch: tuple[int, int]
    channels: int
    image: int
    moe_blocks: tuple[int, ...]
    experts: int
    classes: int
    pre_logits: bool

    @property
    def tokens(self) -> int:
        """Tokens per image: the patches and [CLS]."""
        return (self.image // self.patch[0]) ** 2 + 1


def open_vmoe(path: str | Path) -> TreeReader:
    """The reader of a vmoe checkpoint prefix (or its `.index`) or of an Orbax checkpoint folder."""
    path = Path(path)
    if path.is_dir():
        if not is_orbax(path):
            raise CheckpointError(f"{path}: a folder without _METADATA, not an Orbax checkpoint; give a vmoe "
                                  f"checkpoint by its prefix (PREFIX for PREFIX.index and PREFIX.data-*)")
        return OrbaxCheckpoint(path)
    return LegacyCheckpoint(path.with_suffix("") if path.suffix == ".index" else path)


def architecture(shapes: dict[str, tuple[int, ...]], source: Path) -> VmoeArchitecture:
    """The V-MoE ViT whose tree has these shapes; a tree that is not one is a CheckpointError naming a tensor."""
    def need(name: str, dims: int) -> tuple[int, ...]:
        if name not in shapes:
            raise CheckpointError(f"{source}: no {name}: not a V-MoE (vmoe's VisionTransformerMoe) tree; it has "
                                  f"{', '.join(list(shapes)[:6])}{' ...' if len(shapes) > 6 else ''}")
        if len(shapes[name]) != dims:
            raise CheckpointError(f"{source}: {name} is {list(shapes[name])}, not {dims}-D as in a V-MoE")
        return shapes[name]

    ph, pw, channels, width = need("embedding/kernel", 4)
    tokens = need("Encoder/posembed_input/pos_embedding", 3)[1]
    grid = math.isqrt(max(tokens - 1, 0))
    if ph != pw or grid * grid != tokens - 1 or not grid:
        raise CheckpointError(f"{source}: Encoder/posembed_input/pos_embedding has {tokens} tokens and the patches "
                              f"are {ph} x {pw}: moespec imports square images and patches with a [CLS] token")
    need("cls", 3)
    blocks = sorted({int(m.group(1)) for name in shapes if (m := BLOCK.match(name))})
    if not blocks or blocks != list(range(len(blocks))):
        raise CheckpointError(f"{source}: encoder blocks {blocks}: not a V-MoE's numbered encoderblock_0 ... _N")
    moe = tuple(i for i in blocks if f"Encoder/encoderblock_{i}/Moe/Router/dense/kernel" in shapes)
    if not moe:
        raise CheckpointError(f"{source}: no block has Moe/Router/dense/kernel: a dense ViT, not a V-MoE")
    experts, _, mlp = need(f"Encoder/encoderblock_{moe[0]}/Moe/Mlp/Dense_0/kernel", 3)
    heads = need("Encoder/encoderblock_0/SelfAttention/query/kernel", 3)[1]
    classes = need("head/kernel", 2)[1]
    arch = VmoeArchitecture(width, len(blocks), heads, mlp, (ph, pw), channels, grid * ph, moe, experts, classes,
                            "pre_logits/kernel" in shapes)
    expected = expected_shapes(arch)
    unknown = [name for name in shapes if name not in expected]
    if unknown:
        raise CheckpointError(f"{source}: {unknown[0]}: not part of a V-MoE ViT ({len(unknown)} such tensors); "
                              f"moespec imports vmoe's VisionTransformerMoe")
    for name, shape in expected.items():
        if name not in shapes:
            raise CheckpointError(f"{source}: no {name}, which a V-MoE of this shape has")
        if tuple(shapes[name]) != shape:
            raise CheckpointError(f"{source}: {name} is {list(shapes[name])}, but the V-MoE the other tensors give "
                                  f"(width {width}, {heads} heads, MLP {mlp}, {experts} experts) has {list(shape)}")
    return arch


def expected_shapes(arch: VmoeArchitecture) -> dict[str, tuple[int, ...]]:
    return {name: shape for name, (shape, _, _) in _mapping(arch).items()}


Transform = Callable[[np.ndarray], np.ndarray]


def _mapping(arch: VmoeArchitecture) -> dict[str, tuple[tuple[int, ...], str, Transform]]:
    """Tree name -> (its shape, the timm tensor it fills, how: JAX's [in, out] kernels become torch's [out, in]).
    The query, key and value of a block fill thirds of timm's fused `qkv` (their torch names end in `[i]`)."""
    d, h, m, e, k = arch.width, arch.heads, arch.mlp, arch.experts, arch.classes
    same, t = (lambda a: a), (lambda a: a.T)
    out = {"embedding/kernel": ((*arch.patch, arch.channels, d), "patch_embed.proj.weight",
                                lambda a: a.transpose(3, 2, 0, 1)),
           "embedding/bias": ((d,), "patch_embed.proj.bias", same), "cls": ((1, 1, d), "cls_token", same),
           "Encoder/posembed_input/pos_embedding": ((1, arch.tokens, d), "pos_embed", same),
           "Encoder/encoder_norm/scale": ((d,), "norm.weight", same),
           "Encoder/encoder_norm/bias": ((d,), "norm.bias", same),
           "head/kernel": ((d, k), "head.weight", t), "head/bias": ((k,), "head.bias", same)}
    if arch.pre_logits:
        out["pre_logits/kernel"] = ((d, d), "fc_norm.fc.weight", t)
        out["pre_logits/bias"] = ((d,), "fc_norm.fc.bias", same)
    for i in range(arch.depth):
        jax, torch_ = f"Encoder/encoderblock_{i}/", f"blocks.{i}."
        for n, norm in ((0, "norm1"), (1, "norm2")):
            out[f"{jax}LayerNorm_{n}/scale"] = ((d,), f"{torch_}{norm}.weight", same)
            out[f"{jax}LayerNorm_{n}/bias"] = ((d,), f"{torch_}{norm}.bias", same)
        for third, part in enumerate(("query", "key", "value")):
            out[f"{jax}SelfAttention/{part}/kernel"] = ((d, h, d // h), f"{torch_}attn.qkv.weight[{third}]",
                                                        lambda a: a.reshape(a.shape[0], -1).T)
            out[f"{jax}SelfAttention/{part}/bias"] = ((h, d // h), f"{torch_}attn.qkv.bias[{third}]",
                                                      lambda a: a.reshape(-1))
        out[f"{jax}SelfAttention/out/kernel"] = ((h, d // h, d), f"{torch_}attn.proj.weight",
                                                 lambda a: a.reshape(-1, a.shape[-1]).T)
        out[f"{jax}SelfAttention/out/bias"] = ((d,), f"{torch_}attn.proj.bias", same)
        if i in arch.moe_blocks:
            experts = lambda a: a.transpose(0, 2, 1)  # noqa: E731  [E, in, out] -> [E, out, in]
            out[f"{jax}Moe/Router/dense/kernel"] = ((d, e), f"{torch_}mlp.router.gate.weight", t)
            out[f"{jax}Moe/Mlp/Dense_0/kernel"] = ((e, d, m), f"{torch_}mlp.experts.fc1.weight", experts)
            out[f"{jax}Moe/Mlp/Dense_0/bias"] = ((e, m), f"{torch_}mlp.experts.fc1.bias", same)
            out[f"{jax}Moe/Mlp/Dense_1/kernel"] = ((e, m, d), f"{torch_}mlp.experts.fc2.weight", experts)
            out[f"{jax}Moe/Mlp/Dense_1/bias"] = ((e, d), f"{torch_}mlp.experts.fc2.bias", same)
        else:
            out[f"{jax}Mlp/Dense_0/kernel"] = ((d, m), f"{torch_}mlp.fc1.weight", t)
            out[f"{jax}Mlp/Dense_0/bias"] = ((m,), f"{torch_}mlp.fc1.bias", same)
            out[f"{jax}Mlp/Dense_1/kernel"] = ((m, d), f"{torch_}mlp.fc2.weight", t)
            out[f"{jax}Mlp/Dense_1/bias"] = ((d,), f"{torch_}mlp.fc2.bias", same)
    return out


def vmoe_spec(arch: VmoeArchitecture, *, top_k: int, capacity_factor: float | None, group_size: int,
              batch_priority: bool = False, name: str = "vmoe") -> Spec:
    """The moespec spec of `arch` with V-MoE's routing: `top_k` experts per token, each expert taking at most
    ceil(capacity_factor * top_k * group_size / experts) tokens of a group, rounded up to a multiple of 4, in groups
    of `group_size` tokens (vmoe counts them in tokens: a multiple of the tokens of an image), BPR if
    `batch_priority`, V-MoE's router noise (1 / experts) and load-balancing losses in training."""
    if not 1 <= top_k <= arch.experts:
        raise MoespecError(f"top_k {top_k}: the checkpoint's MoE layers have {arch.experts} experts; give 1 to "
                           f"{arch.experts} (V-MoE: 2)")
    if capacity_factor is not None and not capacity_factor > 0:
        raise MoespecError(f"capacity_factor {capacity_factor}: give a factor above 0 (V-MoE: 1.05; from "
                           f"{arch.experts / top_k:g} on, nothing is dropped)")
    if group_size < 1 or group_size % arch.tokens:
        raise MoespecError(f"group_size {group_size}: vmoe's routing groups are counted in tokens, and an image here "
                           f"is {arch.tokens} ({arch.image // arch.patch[0]}^2 patches and [CLS]); give a multiple of "
                           f"{arch.tokens} (V-MoE's configs: 8 images, {8 * arch.tokens})")
    if int(arch.width * (arch.mlp / arch.width)) != arch.mlp:
        raise MoespecError(f"MLP width {arch.mlp} is not a ratio of the width {arch.width} that timm's ViT can build")
    kwargs = {"img_size": arch.image, "patch_size": arch.patch[0], "embed_dim": arch.width, "depth": arch.depth,
              "num_heads": arch.heads, "mlp_ratio": arch.mlp / arch.width, "num_classes": arch.classes,
              "act_layer": "gelu_tanh"}
    if arch.channels != 3:
        kwargs["in_chans"] = arch.channels
    router = {"top_k": top_k, "noise": True}
    if capacity_factor is not None:
        router.update(capacity_factor=capacity_factor, capacity_multiple=CAPACITY_MULTIPLE,
                      group=group_size // arch.tokens, bpr=batch_priority)
    elif batch_priority:
        raise MoespecError("batch_priority orders the tokens that fill a capacity; give a capacity_factor")
    return load_spec({
        "name": name,
        "backbone": {"model": TIMM_VITS.get(arch.patch[0], TIMM_VITS[16]), "kwargs": kwargs,
                     "pre_logits": arch.pre_logits},
        "input_size": [arch.channels, arch.image, arch.image],
        "moe": [{"where": {"blocks": list(arch.moe_blocks)}, "experts": arch.experts, "router": router,
                 "aux_loss": {"kind": "importance_load", "weight": IMPORTANCE_LOAD_WEIGHT}}]})


def import_vmoe(path: str | Path, *, top_k: int, capacity_factor: float | None, group_size: int,
                batch_priority: bool = False) -> nn.Module:
    """The moespec model of a V-MoE checkpoint: a timm `VisionTransformer` with MoE layers, its spec attached
    (`moespec.save` writes it; `moespec.load` rebuilds it), in training mode as `create_model` and `load` return
    theirs. See `vmoe_spec` for the options."""
    reader = open_vmoe(path)
    arch = architecture(reader.shapes(), reader.index)
    spec = vmoe_spec(arch, top_k=top_k, capacity_factor=capacity_factor, group_size=group_size,
                     batch_priority=batch_priority, name=_name(path))
    model = create_model(spec, seed=0)
    fill(model, reader, arch)
    return model


def fill(model: nn.Module, reader: TreeReader, arch: VmoeArchitecture) -> None:
    """Copy every tensor of `reader` into `model`'s parameters, one at a time."""
    mapping, state = _mapping(arch), model.state_dict()
    filled: set[str] = set()
    for name, array in reader.tensors():
        shape, target, transform = mapping[name]
        if tuple(array.shape) != shape:
            raise CheckpointError(f"{reader.index}: {name}: the data is {list(array.shape)}, the tree says "
                                  f"{list(shape)}")
        third = re.fullmatch(r"(.*)\[(\d)\]", target)
        tensor = state[third.group(1) if third else target]
        if third:
            rows = tensor.shape[0] // 3
            tensor = tensor[int(third.group(2)) * rows:(int(third.group(2)) + 1) * rows]
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(np.ascontiguousarray(transform(array))))
        filled.add(target)
        del array
    parameters = {target for _, target, _ in mapping.values()}
    if filled != parameters:
        raise CheckpointError(f"{reader.index}: {sorted(parameters - filled)[0]} was never read")


def _name(path: str | Path) -> str:
    name = Path(path).name.removesuffix(".index")
    return re.sub(r"[^\w.-]+", "-", name) or "vmoe"

"""A backbone as plain data: its residual blocks (what selectors resolve against), its FFN shapes, and the
few other facts a plan reads (`BackboneSketch`).

`backbones.discovery` fills these from a timm model; the spec and plan stages only read them, so the types
live here, below both. Being plain data, a sketch is cached between runs (`planning.cache`): a plan of a
backbone seen before needs neither torch nor timm.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Block:
    """One residual block: its qualified name, its FFN sublayers (relative names), and its stage."""

    index: int  # global, network order
    path: str  # e.g. "stages.2.blocks.8"
    stage: int
    sublayers: tuple[str, ...]  # e.g. ("mlp",) or ("mlp_tokens", "mlp_channels")


@dataclass(frozen=True)
class BlockLayout:
    """The residual blocks of a model in network order, grouped into stages."""

    blocks: tuple[Block, ...]
    stages: tuple[tuple[int, ...], ...]  # global block indices per stage

    def describe(self) -> str:
        sizes = ", ".join(str(len(s)) for s in self.stages)
        first, last = self.blocks[0].path, self.blocks[-1].path
        return f"{len(self.blocks)} blocks ({first} .. {last}) in {len(self.stages)} stage(s) of sizes [{sizes}]"


@dataclass(frozen=True)
class FFNShape:
    """A dense FFN's widths and layout. `hidden` is the width fc2 reads (after gating, for GLUs)."""

    family: str  # the adapter's name, e.g. "Mlp"
    in_features: int
    hidden: int
    out_features: int
    channels_dim: int  # -1: features last ([B, N, C] or [B, H, W, C]); 1: [B, C, H, W]
    mixes: str = ""  # why the FFN mixes positions (a depthwise conv, a spatial gate): then only whole images route


@dataclass(frozen=True)
class Rescalable:
    """A block that `rescale` can rebuild (MLP-Mixer): its shape [S, C] and which FFN mixes which axis."""

    tokens: int
    channels: int
    token_sublayer: str
    channel_sublayer: str


@dataclass(frozen=True)
class BackboneSketch:
    """What planning reads of a dense backbone, and nothing else: no modules, no tensors."""

    layout: BlockLayout
    ffns: dict[str, FFNShape] = field(hash=False)  # every FFN sublayer of every block, in module order
    block_types: dict[str, str] = field(hash=False)  # block path -> its class name
    rescalable: dict[str, Rescalable] = field(hash=False)  # block path -> its facts, for blocks rescale rebuilds
    rebuilt_types: tuple[str, ...]  # the block classes rescale rebuilds (registered rebuilders), for messages
    has_cls_token: bool
    input_size: tuple[int, int, int]  # the pretrained_cfg's input size, (C, H, W)

"""The residual blocks of a backbone, as plain data: what selectors resolve against.

`backbones.discovery.find_blocks` fills a `BlockLayout` from a timm model; the spec stage only reads it, so
this type lives here, below both.
"""

from __future__ import annotations

from dataclasses import dataclass


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

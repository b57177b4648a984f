"""Finding the residual blocks and stages of a timm model from its module tree.

Discovery is generic, not a table per model name: an FFN is any module an adapter in `adapters.py`
recognizes; its block is its deepest ancestor that is an element of an `nn.Sequential` / `nn.ModuleList`;
blocks that sit in the same container form a stage. ViT gets one stage of `blocks.i`; ConvNeXt gets four
stages of `stages.s.blocks.b`.

`sketch_of` adds what else a plan reads (FFN shapes, rebuildable blocks, the [CLS] token, the input size)
and returns it all as plain data, a `spec.BackboneSketch`.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ..errors import Problem, SpecError
from ..spec import BackboneSketch, Block, BlockLayout, FFNShape, Rescalable
from .adapters import ADAPTERS, find_adapter
from .rebuilders import BLOCK_REBUILDERS, find_rebuilder


def find_blocks(model: nn.Module) -> BlockLayout:
    """Discover the residual blocks and stages of `model` (see the module docstring)."""
    containers = {name for name, m in model.named_modules() if isinstance(m, (nn.Sequential, nn.ModuleList))}
    block_sublayers: dict[str, list[str]] = {}
    block_stage: dict[str, str] = {}
    for name, module in model.named_modules():
        if not name or not _convertible(module):
            continue
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):  # deepest proper ancestor first
            parent = ".".join(parts[: cut - 1])
            if parent in containers or (cut == 1 and "" in containers):
                block = ".".join(parts[:cut])
                block_sublayers.setdefault(block, []).append(".".join(parts[cut:]))
                block_stage[block] = parent
                break
    if not block_sublayers:
        raise SpecError(Problem(_why_no_blocks(model), path="backbone.model"))
    stage_names: list[str] = []
    blocks = []
    for index, (path, sublayers) in enumerate(block_sublayers.items()):
        if block_stage[path] not in stage_names:
            stage_names.append(block_stage[path])
        blocks.append(Block(index, path, stage_names.index(block_stage[path]), tuple(sublayers)))
    stages = tuple(tuple(b.index for b in blocks if b.stage == s) for s in range(len(stage_names)))
    return BlockLayout(tuple(blocks), stages)


def _why_no_blocks(model: nn.Module) -> str:
    """Why `find_blocks` found nothing: no FFN at all, FFNs of classes no adapter knows, or known FFNs outside
    any block."""
    modules = [(name, m) for name, m in model.named_modules() if name]
    known = [(name, type(m).__name__) for name, m in modules if _convertible(m)]
    refused = [(name, type(m).__name__, adapter.refusal(m)) for name, m in modules
               if (adapter := find_adapter(m)) is not None and adapter.refusal(m) is not None]
    unknown = [(name, type(m).__name__) for name, m in modules  # not a top-level head or pre-logits MLP
               if "." in name and find_adapter(m) is None and looks_like_ffn(m)]
    families = _families()

    def listed(found: list[tuple[str, str]]) -> str:
        shown = ", ".join(f"{name} ({cls})" for name, cls in found[:3])
        return shown + (f" and {len(found) - 3} more" if len(found) > 3 else "")

    if known:
        return (f"found FFNs, but none inside a block of an nn.Sequential / nn.ModuleList, which is how moespec "
                f"finds residual blocks: {listed(known)}")
    if refused:
        name, cls, reason = refused[0]
        more = f" (and {len(refused) - 1} more FFNs)" if len(refused) > 1 else ""
        return f"this model's FFNs cannot be split into experts: {name}{more} ({cls}): {reason}"
    if unknown:
        classes = sorted({cls for _, cls in unknown})
        return (f"this model's FFN class{'es' if len(classes) > 1 else ''} {', '.join(classes)} "
                f"{'have' if len(classes) > 1 else 'has'} no moespec adapter yet ({listed(unknown)}); supported FFN "
                f"families: {families}")
    return f"this model has no FFN sublayer; MoE surgery needs one (supported FFN families: {families})"


def _families(shown: int = 5) -> str:
    """The FFN families moespec knows, the first few by name (the list grows with every timm release)."""
    names = list(dict.fromkeys(adapter.family for adapter in ADAPTERS.values()))
    more = f" and {len(names) - shown} more (moespec/backbones/families.py)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _convertible(module: nn.Module) -> bool:
    """An FFN an adapter knows and can split into experts."""
    adapter = find_adapter(module)
    return adapter is not None and adapter.refusal(module) is None


def looks_like_ffn(module: nn.Module) -> bool:
    """A module that is an FFN by its class name (it says Mlp, MLP, FFN or FeedForward, and is not a classifier
    head). Not by fc1 / fc2 children: squeeze-and-excitation and split attention have those too."""
    name = type(module).__name__.lower()
    return any(word in name for word in ("mlp", "ffn", "feedforward")) and not name.endswith(("head", "classifier"))


def _shape(ffn: nn.Module) -> FFNShape:
    """The FFN's shape, with why it mixes positions where it does (`Adapter.mixes_positions`)."""
    adapter = find_adapter(ffn)
    return dataclasses.replace(adapter.shape(ffn), mixes=adapter.mixes_positions(ffn) or "")


def sketch_of(model: nn.Module) -> BackboneSketch:
    """What a plan reads of `model`, as plain data (see `spec.BackboneSketch`)."""
    layout = find_blocks(model)
    modules = dict(model.named_modules())
    sublayers = {f"{block.path}.{sublayer}" for block in layout.blocks for sublayer in block.sublayers}
    ffns = {path: _shape(module) for path, module in modules.items() if path in sublayers}
    blocks = {block.path: modules[block.path] for block in layout.blocks}
    rescalable = {}
    for path, block in blocks.items():
        rebuilder = find_rebuilder(block)
        if rebuilder is not None:
            tokens, channels = rebuilder.shape(block)
            rescalable[path] = Rescalable(tokens, channels, rebuilder.token_sublayer, rebuilder.channel_sublayer)
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return BackboneSketch(
        layout=layout, ffns=ffns, block_types={path: type(block).__name__ for path, block in blocks.items()},
        rescalable=rescalable, rebuilt_types=tuple(cls.__name__ for cls in BLOCK_REBUILDERS),
        has_cls_token=getattr(model, "cls_token", None) is not None,
        input_size=tuple(cfg.get("input_size", (3, 224, 224))))

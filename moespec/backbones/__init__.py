"""Stage 2, backbones: everything that knows timm. Creating the dense model, discovering its blocks and
stages, reading and rebuilding its FFN families (adapters) and its residual blocks (rebuilders).

    create.py     create_backbone            discovery.py  find_blocks, sketch_of -> spec.BackboneSketch
    adapters.py   one adapter per FFN family rebuilders.py  blocks rebuilt at a rescaled shape (Sparse-MLP)
    composed.py   FFNs of plain parts          families.py   timm's composed FFN classes, one line each
    placement.py  resolve_device, refuse_if_too_large: where a build goes, and whether it fits there
    weightless.py create_weightless_backbone: parameters with shapes and no storage, for counting
    meta.py       SkipMetaWrites: initializers skipped on meta tensors, which hold no values to write
"""

from . import families  # noqa: F401  (registers the adapters of timm's composed FFN classes)
from .adapters import ADAPTERS, Adapter, FFNShape, adapter_named, find_adapter, register_adapter
from .create import create_backbone
from .discovery import find_blocks, sketch_of
from .placement import device_memory, refuse_if_too_large, resolve_device
from .rebuilders import BLOCK_REBUILDERS, BlockRebuilder, find_rebuilder, register_rebuilder
from .weightless import create_weightless_backbone

__all__ = ["ADAPTERS", "Adapter", "BLOCK_REBUILDERS", "BlockRebuilder", "FFNShape", "adapter_named", "create_backbone",
           "create_weightless_backbone", "device_memory", "find_adapter", "find_blocks", "find_rebuilder",
           "refuse_if_too_large", "register_adapter", "register_rebuilder", "resolve_device", "sketch_of"]

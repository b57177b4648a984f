"""The one rule that maps a dense checkpoint onto the compiled MoE model of a plan, for every path that reads
one (`upcycle_into` in memory, the streamed writer, `moespec.distributed.upcycle`)."""

from __future__ import annotations

import torch

from ..planning import Plan


def dense_to_moe(plan: Plan, dense: dict[str, torch.Tensor]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Split the dense state dict `dense` by what becomes of each name in the MoE model of `plan`:

    - plain: name -> tensor, copied as it is (every name outside the planned FFNs and rebuilt blocks);
    - FFN states: MoE layer path -> {name within the FFN: tensor}, the dense FFN that `upcycle_layer` copies
      into that layer's experts (e.g. "blocks.1.mlp" -> {"fc1.weight": ...}).

    A block that a rescale rebuilds (with the FFNs in it) is in neither: no dense tensor has its new shape, so
    it keeps its fresh init. The tensors are `dense`'s own, not copies.
    """
    layers = [layer.path for layer in plan.layers if plan.rebuilt(layer.path) is None]
    skip = tuple(f"{layer.path}." for layer in plan.layers) + tuple(f"{r.block}." for r in plan.rescales)
    plain = {name: tensor for name, tensor in dense.items() if not name.startswith(skip)}
    ffns: dict[str, dict[str, torch.Tensor]] = {path: {} for path in layers}
    for name, tensor in dense.items():
        for path in layers:
            if name.startswith(path + "."):
                ffns[path][name[len(path) + 1:]] = tensor
    return plain, ffns

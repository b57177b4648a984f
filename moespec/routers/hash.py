"""Router kind `hash` (Roller et al. 2021, "Hash Layers For Large Sparse Models"): every item goes to one expert
chosen by a fixed hash, with weight 1; nothing is learned, nothing needs balancing.

Roller et al. hash the token id; image tokens have none, so here an item is hashed by its position within its
image (patch n of a sequence, or the n-th position of a feature map): a seeded permutation of the positions,
dealt to the experts in turn, so every expert gets the same number of positions (within one).

This kind is the README's worked example of extending moespec, and it is opt-in: `import moespec.routers.hash`
registers it; the built-in spec language and its JSON Schema do not have it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import Mode, Router, Routing
from ..layers.ops.pairs import stable_argsort
from ..layers.routing import items_per_image
from ..spec.fields import IntRange
from ..spec.registry import RouterSpec, register_router_kind
from .gates import TOKENS, sparse_moe


@register_router_kind
class HashRouterSpec(RouterSpec):
    """Hash routing (Roller et al. 2021): each position of an image always goes to the same expert."""

    kind: Literal["hash"]
    seed: IntRange(0, 2**64 - 1) = 0  # what torch.Generator.manual_seed takes
    """Seed of the position -> expert permutation."""

    title: ClassVar[str] = "hash"
    fixed_experts: ClassVar[str] = (
        "items go to experts by a fixed hash of their position, which no gate rows decide")
    rows_per_expert: ClassVar[bool] = False  # no weights: routes by position
    load_balanced: ClassVar[bool] = False  # balanced by construction
    inspection: ClassVar = TOKENS

    def build(self, layer: Any, experts: Any, shared: Any) -> nn.Module:
        return sparse_moe(HashRouter(layer.num_experts, self.seed), layer, experts, shared)

    def describe(self, layer: Any) -> str:
        return f"hash seed={self.seed}"

    # caveats: none. One copy of the dense FFN per item with weight 1 computes the dense function.


class HashRouter(Router):
    """Routes item n of each image to expert `table[n]`: a seeded permutation of the positions dealt to the
    experts in turn. No parameters; the routing does not depend on the input."""

    def __init__(self, num_experts: int, seed: int = 0):
        super().__init__()
        self.num_experts, self.seed = num_experts, seed

    def table(self, positions: int, device: torch.device) -> torch.Tensor:
        """[positions] expert of each position of an image, each expert taking positions / E of them (+1)."""
        order = torch.randperm(positions, generator=torch.Generator().manual_seed(self.seed))
        return (torch.empty_like(order).index_copy_(0, order, torch.arange(positions)) % self.num_experts).to(device)

    def gate_macs(self, items: int, images: int) -> int:
        return 0

    def experts_per_item(self, items: int, images: int) -> float:
        return 1

    def route(self, x: torch.Tensor, images: int = 1, mode: Mode | None = None) -> Routing:
        """x: [T, C] items, image after image -> a Routing with one (item, expert) pair per item."""
        mode = Mode.of(x) if mode is None else mode
        experts = self.table(items_per_image(x.shape[0], images), x.device).repeat(images)  # [T]
        item = stable_argsort(experts, exporting=mode.exporting)  # pairs by expert, in item order within each
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).index_add_(
            0, experts, torch.ones_like(experts))
        probs = F.one_hot(experts, self.num_experts).float()  # [T, E]: the hash is certain
        ones = torch.ones(x.shape[0], device=x.device)
        return Routing(probs=probs, logits=torch.zeros_like(probs), item=item, counts=counts,
                       weights=ones.to(x.dtype)[item], top1=experts, top1_value=ones, load=counts.float(),
                       kept=torch.ones(x.shape[0], dtype=torch.bool, device=x.device), expert=experts[item],
                       mode=mode)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, seed={self.seed}"

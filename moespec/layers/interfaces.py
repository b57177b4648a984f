"""The two interfaces every later stage leans on, declared in one place.

    Router    items [T, C] -> Routing           topk, image, expert choice (routers.py), hash (routers/hash.py)
    MoELayer  x -> y where a dense FFN was      MoE (moe.py, around a Router), SoftMoE (soft.py)

The compiler swaps in `MoELayer`s; the counters, `aux_loss`, upcycling, expert parallelism and `inspect` use
nothing but what these classes declare. A new router kind subclasses `Router` (and is wrapped in `MoE`); a layer
with its own dispatch subclasses `MoELayer`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import NotScriptableError
from .experts import Experts
from .ops.mode import Mode
from .routing import Routing


class Router(nn.Module):
    """Decides which expert each item goes to, with which weight. Subclasses set `num_experts` and override
    `route`, `gate_macs` and `experts_per_item`; the others have the defaults of a router that dispatches
    every item and keeps every pair.

    The MoE layer calls `route`, not the module: module hooks (torchinfo's, fvcore's, a user's) see only
    tensors, and a `Routing` record is no tensor (torchinfo refused every MoE model). Its gate modules are
    called as modules, so the tools still see and count them. `router(x, images)` is `route` too."""

    num_experts: int

    def route(self, x: torch.Tensor, images: int = 1, mode: Mode | None = None) -> Routing:
        """x: [T, C] items, image after image (T / images each) -> their (item, expert) pairs, grouped by expert,
        in a layer call that runs as `mode` says (`ops.mode.Mode`: the sync-free path, torch.export, ...; None: a
        call that starts here, `Mode.of(x)`), which the Routing carries on (`Routing.mode`)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, images: int = 1, mode: Mode | None = None) -> Routing:
        return self.route(x, images, mode)

    def gate_macs(self, items: int, images: int) -> int:
        """MACs of the routing decision for `items` items in `images` images."""
        raise NotImplementedError

    def experts_per_item(self, items: int, images: int) -> float:
        """Routed experts one item uses, on average, in a forward of `items` items in `images` images under
        perfect balance and before any drop: k for top-k, E·C/T for expert choice. It is the one rule behind
        both counts: the activated parameters (this many routed experts per item) and the activated MACs (this
        many expert rows per dispatched item)."""
        raise NotImplementedError

    def dispatched(self, items: int) -> int:
        """Items of `items` that reach any expert at all (importance-score routing keeps some out)."""
        return items

    def router_weights(self) -> list[nn.Parameter]:
        """The weights that upcycling draws afresh: every parameter, unless a router says otherwise (its gate's
        projection and codes, not a learnable temperature)."""
        return list(self.parameters())

    def capacity_rows(self, items: int) -> int | float | None:
        """Expert rows per `items` (one image's) with every expert at its full capacity; None when dropless."""
        return None

    def group_slots(self, items: int) -> tuple[int, int] | None:
        """(images per routing group, expert slots per group: E x capacity of the group's items) for `items`
        per image, as the one-hot dispatch and combine einsums of JAX implementations (V-MoE, Soft MoE's
        baselines) size their [S, E, C] tensors; None for a router without a capacity buffer (dropless)."""
        return None

    def gate_input(self, x: torch.Tensor, images: int = 1) -> torch.Tensor:
        """The vectors the gate scores for items x [T, C] of `images` images: the items themselves, unless a
        router reads one vector per image."""
        return x

    def point_at(self, vectors: torch.Tensor) -> None:
        """Start the gate with expert i's row along `vectors[i]` ([E, C], in the space of `gate_input`), scaled
        as the gate expects (`upcycle.router_init: hidden | kmeans`). Routers without a row per expert refuse."""
        raise NotImplementedError(f"{type(self).__name__} has no gate row per expert to start from data")

    def row_metric(self) -> str:
        """How the gate compares an item with a row: "dot" (linear), "cosine" or "l2" (k-means clusters alike)."""
        raise NotImplementedError(f"{type(self).__name__} has no gate row per expert")


class MoELayer(nn.Module):
    """What replaces a dense FFN call site. Subclasses build `experts` (the routed `Experts` bank), `shared`
    (always-active experts, or None) and `channels_dim` (-1: [..., C] inputs; 1: [B, C, H, W]), keep
    `aux_losses` (aux-loss kind -> value of the last forward) and `last_items` / `last_images` (the size of the
    last forward), and override the methods that raise here. Their forward is decorated with `ops.mode.layer_call`,
    so that torch.fx traces it as one node and a TorchScript trace says what it fixes; `torch.jit.script` is refused
    here (`__prepare_scriptable__`)."""

    experts: Experts
    shared: Experts | None
    pre: nn.Module | None  # the FFN's own input module (a norm, a depthwise conv), dense and shared, or None
    channels_dim: int
    aux_losses: dict[str, torch.Tensor]
    last_items: int
    last_images: int

    def __init__(self):
        super().__init__()
        self.pre = None  # set by the builder where the dense FFN has one (`Adapter.pre_module`)

    def __prepare_scriptable__(self) -> nn.Module:
        """`torch.jit.script` asks every module for this before it compiles any: the one refusal it meets."""
        raise NotScriptableError(
            f"moespec: torch.jit.script cannot compile the {type(self).__name__} layer: its forward is Python that "
            f"TorchScript does not support (expert steps chosen at run time, shapes that depend on the data). Export "
            f"the model instead: torch.export.export(model, (x,)), whose graph routes each input "
            f"(torch.onnx.export(model, (x,), dynamo=True) for ONNX)")

    def run_pre(self, x: torch.Tensor) -> torch.Tensor:
        """x through `pre`, which runs on the whole input before routing."""
        return x if self.pre is None else self.pre(x)

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def experts_per_item(self, items: int, images: int) -> float:
        """Routed experts one item uses (see `Router.experts_per_item`): the activated parameters count this
        many of the bank's experts per item."""
        raise NotImplementedError

    def activated_macs(self, items: int, images: int) -> int:
        """MACs of a forward of `items` items in `images` images, under perfect balance and no drops."""
        raise NotImplementedError

    def executed_macs(self, items: int, images: int) -> int | None:
        """MACs with every expert padded to its capacity (None for a layer without one)."""
        return None

    def exported_macs(self, items: int, images: int) -> int:
        """MACs of the layer in a `torch.export` graph, where no shape may depend on the data: a layer that routes
        sparsely runs every expert on every item there (E / k times its experts' compute); the default, a layer
        whose forward is the same function exported (Soft MoE), its activated MACs."""
        return self.activated_macs(items, images)

    def einsum_macs(self, items: int, images: int) -> int | None:
        """MACs with dispatch and combine as one-hot einsums over each routing group (`stats --dispatch-flops
        einsum`); None for a layer whose count does not change with it."""
        return None

    def router_weights(self) -> list[nn.Parameter]:
        """The weights that decide the routing, which upcycling initializes afresh."""
        raise NotImplementedError

    def routing_stats(self) -> dict[str, object] | None:
        """Items per expert, the share of items no expert took and the mean top-1 gate of the last forward
        (None before the first)."""
        raise NotImplementedError

    def gate_input(self, x: torch.Tensor) -> torch.Tensor:
        """The vectors [U, C] the router scores for the layer's input `x` already through `pre` (upcycling
        records them to start the router from data; `Router.gate_input`)."""
        raise NotImplementedError(f"{type(self).__name__} has no gate row per expert to start from data")

    def gate_router(self) -> Router:
        """The router whose rows `upcycle.router_init: hidden | kmeans` starts (`Router.point_at`). A method, not a
        property: tools that scan a module's attributes with hasattr (`torch.jit.trace`) would see it raise."""
        raise NotImplementedError(f"{type(self).__name__} has no gate row per expert to start from data")

    def weighted_aux_loss(self) -> torch.Tensor | None:
        """Sum of weight * aux loss of the last forward (None without one)."""
        return None

    def shared_macs(self) -> int:
        """MACs of the shared experts on one item."""
        return self.shared.num_experts * self.shared.macs_per_item() if self.shared is not None else 0

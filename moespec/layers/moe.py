"""The sparse MoE layer that replaces a dense FFN call site.

    items = x as rows [T, C]  (tokens of [B, N, C], or positions of a [B, H, W, C] / [B, C, H, W] map)
    routing = router.route(items) -> (item, expert) pairs grouped by expert, with gate weights
                                     (under torch.export: every expert on every item, combined densely)
    y = experts.combine(...)      -> items[pairs], one contiguous segment per expert, then the weighted
                                     scatter back (without autograd, under the loop step, segment by
                                     segment); an item no expert took gets 0 (its residual carries it)
    y += shared experts(items)    -> always-active experts, if any
    AuxLossAutoScaler(y, aux)     -> with aux_loss_in_backward: the aux loss's gradient rides on y's backward

The router decides everything about who goes where (top-k, capacity, BPR, drops, expert choice, image
level); this layer only moves rows. `SoftMoE` (soft.py) is the one layer with its own dispatch.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..errors import MoespecError
from .balancing import BIAS_ON_STEP
from .experts import Experts
from .interfaces import MoELayer, Router
from .ops.mode import Mode, autocast_dtype, layer_call
from .routing import AUX_LOSSES, Routing, items_per_image


class MoE(MoELayer):
    """Sparse mixture of experts over the items of a token sequence or feature map.

    Args:
        router: a `Router` (`interfaces.py`), called as router.route(items [T, C], images, mode) -> Routing.
        experts: the routed `Experts` bank.
        shared: an `Experts` bank of always-active experts, or None.
        channels_dim: where the features are: -1 for [..., C] inputs, 1 for [B, C, H, W].
        aux_loss_weights: aux-loss kind -> weight, summed by `moespec.aux_loss(model)`.
        aux_loss_in_backward: attach the weighted aux loss to the output with `AuxLossAutoScaler`, so that its
            gradient reaches the router in backward without `moespec.aux_loss`, times
        aux_loss_backward_scale: the loop's loss factor (1/N for N accumulation steps), and the scale of the
            GradScaler given to `follow_grad_scaler`, if any.
    """

    def __init__(self, router: Router, experts: Experts, shared: Experts | None = None, *, channels_dim: int = -1,
                 aux_loss_weights: dict[str, float] | None = None, aux_loss_in_backward: bool = False,
                 aux_loss_backward_scale: float = 1.0):
        super().__init__()
        self.router, self.experts, self.shared = router, experts, shared
        self.channels_dim = channels_dim
        self.aux_loss_weights = dict(aux_loss_weights or {})
        self.aux_loss_in_backward = aux_loss_in_backward
        self.aux_loss_backward_scale = aux_loss_backward_scale
        self.grad_scaler = None  # a torch.amp.GradScaler whose current scale multiplies the aux gradient
        self.computed_aux_losses: dict[str, torch.Tensor] = {}  # the kinds forward computed (`aux_losses`)
        self.last_routing: Routing | None = None
        self.last_items = self.last_images = 0

    def __getstate__(self) -> dict:
        """A copy or pickle is of the layer, not of its last forward: the records that hold that forward's graph
        start empty, as in a fresh layer (`copy.deepcopy` refuses tensors inside a graph, so copying a model
        after a forward, as an EMA or a kept best model does, raised)."""
        return {**self.__dict__, "computed_aux_losses": {}, "last_routing": None, "last_items": 0, "last_images": 0}

    @layer_call(fixes_routing=True)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.run_pre(x)
        channels_last = x if self.channels_dim in (-1, x.dim() - 1) else x.movedim(self.channels_dim, -1)
        items = channels_last.reshape(-1, channels_last.shape[-1])
        images = x.shape[0]
        groups = None  # image index per item, only for experts that normalize per image
        if self.experts.needs_groups or (self.shared is not None and self.shared.needs_groups):
            groups = torch.arange(images, device=x.device).repeat_interleave(items_per_image(items.shape[0], images))
        mode = Mode.of(items, self.experts)  # how this call runs, decided once: it travels with the routed rows
        routing = self.router.route(items, images, mode)
        routing.group = self.experts.transport.stats  # data or expert parallel: global aux losses, statistics
        if self.training:
            BIAS_ON_STEP.on_forward(self)  # a balancing bias moves after the optimizer's step (`balancing`)
        static = mode.exporting
        if static:
            y = self._dense_combine(items, routing)
        else:
            y = self.experts.combine(items, routing.rows, groups)
        if self.shared is not None:
            y = y + self.shared.forward_all(items, groups)
        if not static:  # an exported graph is a pure function: no routing state, no aux loss
            self.last_routing, self.last_items, self.last_images = routing, items.shape[0], images
            kinds = AUX_LOSSES if routing.group is not None else self.aux_loss_weights  # see `aux_losses`
            self.computed_aux_losses = {kind: AUX_LOSSES[kind](routing) for kind in kinds}
            loss = self.weighted_aux_loss() if self.aux_loss_in_backward else None
            if loss is not None and loss.requires_grad:
                BACKWARD_SCALE_CHECK.on_forward(self, x)
                y = AuxLossAutoScaler.apply(y, loss, self.backward_scale)
        y = y.reshape(*channels_last.shape[:-1], y.shape[-1])
        return y if channels_last is x else y.movedim(-1, self.channels_dim)

    @property
    def aux_losses(self) -> dict[str, torch.Tensor]:
        """Every aux-loss kind's value for the last forward ({} before one). Forward computes only the weighted
        kinds (a dozen small kernels fewer per layer on a GPU); the others are computed from the last routing
        when asked for (logging). Expert-parallel layers compute all of them in forward: theirs are collectives,
        which every rank must run."""
        routing = self.last_routing
        if routing is None:
            return {}
        done = self.computed_aux_losses
        return {kind: done[kind] if kind in done else loss(routing) for kind, loss in AUX_LOSSES.items()}

    def backward_scale(self) -> float:
        """The aux gradient's scale, read in backward: `aux_loss_backward_scale`, times the current scale of a
        followed GradScaler (the one it multiplied this backward's loss by)."""
        BACKWARD_SCALE_CHECK.on_backward(self)
        scale = self.aux_loss_backward_scale
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            scale = scale * self.grad_scaler.get_scale()
        return scale

    def _dense_combine(self, items: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The export-friendly expert step: every expert on every item, combined with the routing weights (0
        for a pair the router dropped), so that no shape depends on the data. The same function as the sparse
        step, at E / k times its expert compute; used only while `torch.export` traces."""
        if self.experts.needs_groups:
            raise NotImplementedError("GRN experts normalize over the positions they receive, which has no static "
                                      "shape; a model with GRN experts does not export")
        experts, count = self.num_experts, items.shape[0]
        # a scatter-add at item * E + expert: index_put_(accumulate=True), the same sum, made torch.onnx log
        # "Attribute type is ambiguous" once per layer
        combine = items.new_zeros(count * experts).scatter_add(0, routing.item * experts + routing.expert,
                                                               routing.weights).view(count, experts)
        every = items.unsqueeze(0).expand(experts, count, items.shape[1])
        out = self.experts.batched(every, routing.mode)  # [E, T, C']
        return torch.einsum("te,etc->tc", combine, out)

    def router_weights(self) -> list[nn.Parameter]:
        """The weights that decide the routing (the gate's), which upcycling initializes afresh
        (`Router.router_weights`)."""
        return self.router.router_weights()

    def gate_input(self, x: torch.Tensor) -> torch.Tensor:
        channels_last = x if self.channels_dim in (-1, x.dim() - 1) else x.movedim(self.channels_dim, -1)
        return self.router.gate_input(channels_last.reshape(-1, channels_last.shape[-1]), x.shape[0])

    def gate_router(self) -> Router:
        return self.router

    def routing_stats(self) -> dict[str, object] | None:
        """Routing of the last forward: items per expert, share of items no expert took, mean top-1 gate. Under
        expert parallelism they count every rank's batch (a collective: call it on every rank)."""
        routing = self.last_routing
        if routing is None:
            return None
        if routing.group is not None:
            gates = routing.top1_value.detach().double()
            counts, kept, items, gate, units = routing.total(
                routing.counts.double(), routing.kept.sum().double(), gates.new_tensor(self.last_items),
                gates.sum(), gates.new_tensor(gates.numel()))
            return {"tokens_per_expert": counts.long().tolist(), "drop_fraction": 1.0 - (kept / items).item(),
                    "mean_top1_gate": (gate / units).item()}
        return {
            "tokens_per_expert": routing.counts.tolist(),
            "drop_fraction": 1.0 - routing.kept.double().mean().item(),
            "mean_top1_gate": routing.top1_value.double().mean().item(),
        }

    def experts_per_item(self, items: int, images: int) -> float:
        return self.router.experts_per_item(items, images)

    def activated_macs(self, items: int, images: int) -> int:
        """MACs of one forward of `items` items in `images` images, under perfect balance and no drops: the
        gate, each dispatched item's rows through its experts plus the weighted combine, and the shared experts."""
        rows = round(self.experts_per_item(items, images) * self.router.dispatched(items))
        return self._macs(items, images, rows)

    def executed_macs(self, items: int, images: int) -> int | None:
        """MACs with every expert padded to its capacity (None without a capacity factor)."""
        rows = self.router.capacity_rows(items)
        return None if rows is None else self._macs(items, images, rows)

    def exported_macs(self, items: int, images: int) -> int:
        """Every expert on every item, and the combine over all E (`_dense_combine`, what torch.export traces)."""
        return self._macs(items, images, items * self.num_experts)

    def einsum_macs(self, items: int, images: int) -> int | None:
        """MACs as JAX implementations spend them (`stats --dispatch-flops einsum`; None without a capacity):
        dispatch `einsum('SM,SEC->ECM')` and combine `einsum('ECM,SEC->SM')` over each routing group of S items
        into its E x C slots cost S x E x C x (C_in + C_out), and every slot runs through its expert, full or
        not. A group of g images costs that once for g images, so the einsums grow with the group."""
        found = self.router.group_slots(items // max(images, 1))
        if found is None:
            return None
        group_images, slots = found
        einsums = items * slots * (self.experts.in_features + self.experts.out_features)  # S·slots per group
        rows = round(images * slots / group_images)
        return (self.router.gate_macs(items, images) + rows * self.experts.macs_per_item() + einsums
                + items * self.shared_macs())

    def _macs(self, items: int, images: int, rows: int | float) -> int:
        per_row = self.experts.macs_per_item() + self.experts.out_features
        return self.router.gate_macs(items, images) + rows * per_row + items * self.shared_macs()

    def weighted_aux_loss(self) -> torch.Tensor | None:
        """Sum of weight * aux loss of the last forward (None before the first forward or without weights)."""
        if not self.computed_aux_losses or not self.aux_loss_weights:
            return None
        return sum(weight * self.computed_aux_losses[kind] for kind, weight in self.aux_loss_weights.items())

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, channels_dim={self.channels_dim}"


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on a layer's output that also sends a gradient into its aux loss in backward (Megatron-LM's
    `MoEAuxLossAutoScaler`): backward returns the output's gradient unchanged and the layer's backward scale
    as the gradient of `aux_loss`, exactly as if `scale * aux_loss` had been added to the loss being
    differentiated. `scale` is a number, or a function called in backward (`MoE.backward_scale`), so that a
    GradScaler's scale is the one it multiplied this backward's loss by."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor,
                scale: float | Callable[[], float] = 1.0) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = ctx.scale() if callable(ctx.scale) else ctx.scale
        return grad_output, torch.full_like(aux_loss, scale), None


def follow_grad_scaler(model: nn.Module, scaler) -> None:
    """Multiply every MoE layer's in-backward aux gradient by `scaler`'s current scale (a torch.amp.GradScaler,
    or timm's NativeScaler), as the scaler multiplies the task loss; its unscale then divides both alike."""
    scaler = getattr(scaler, "_scaler", scaler)  # timm's NativeScaler wraps a GradScaler
    for layer in model.modules():
        if isinstance(layer, MoE):
            layer.grad_scaler = scaler


class BackwardScaleCheck:
    """Warns, once, when the in-backward aux gradient is likely scaled unlike the task loss:

    - the backward passes per optimizer step (N micro-batches of gradient accumulation) disagree with
      `aux_loss_backward_scale` (which should be 1/N) on two optimizer steps in a row (so that the short last
      accumulation of an epoch does not warn);
    - a training forward runs under float16 autocast, whose loops scale the loss with a GradScaler, and no
      scaler is followed (`follow_grad_scaler`).

    Backward passes are counted per layer in `AuxLossAutoScaler.backward` (a checkpointed forward recomputed in
    backward does not count twice); optimizer steps are seen through torch's global optimizer step hook.
    """

    def __init__(self):
        self.backwards: weakref.WeakKeyDictionary[MoE, int] = weakref.WeakKeyDictionary()
        self.mismatches = 0
        self.hook = None
        self.warned: set[str] = set()

    def on_forward(self, layer: MoE, x: torch.Tensor) -> None:
        if self.hook is None:
            self.hook = register_optimizer_step_post_hook(self.on_step)
        if layer.grad_scaler is None and autocast_dtype(x.device) == torch.float16:
            self._warn("fp16", "moespec: an MoE layer sends its aux loss into backward under float16 autocast, "
                               "where a GradScaler usually multiplies the loss; the aux gradient is then unscaled "
                               "with it and ends up 1/scale too weak. Call moespec.follow_grad_scaler(model, "
                               "scaler) in your loop, or train in bfloat16 (timm's train.py: --amp-dtype bfloat16)")

    def on_backward(self, layer: MoE) -> None:
        self.backwards[layer] = self.backwards.get(layer, 0) + 1

    def on_step(self, optimizer, args, kwargs) -> None:
        counts = {(n, layer.aux_loss_backward_scale) for layer, n in self.backwards.items() if n}
        self.backwards.clear()
        wrong = [(n, scale) for n, scale in counts if abs(n * scale - 1.0) > 1e-6]
        self.mismatches = self.mismatches + 1 if wrong else 0
        if self.mismatches >= 2:
            n, scale = wrong[0]
            self._warn("accumulation", f"moespec: {n} backward passes per optimizer step, but the in-backward aux "
                                       f"loss is scaled by aux_loss_backward_scale = {scale:g}; with gradient "
                                       f"accumulation over {n} micro-batches set it to 1/{n} (the spec's "
                                       f"aux_loss_backward_scale, or register_timm(..., "
                                       f"aux_loss_backward_scale={1 / n:g}))")

    def _warn(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, stacklevel=3)


BACKWARD_SCALE_CHECK = BackwardScaleCheck()


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The load-balancing loss of the last forward: sum over MoE layers of weight * loss (0 if none ran).

    Add it to the task loss: `loss = task_loss + moespec.aux_loss(model)`. Layers built with
    `aux_loss_in_backward` already send their loss's gradient in backward; their part is returned detached
    (for logging), so adding it as well does not count it twice.
    """
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    losses = [loss.detach() if m.aux_loss_in_backward else loss for m in layers
              if (loss := m.weighted_aux_loss()) is not None]
    if not losses:
        return torch.zeros(())
    _check_sharded(model, layers)
    return torch.stack(losses).sum()


def _check_sharded(model: nn.Module, layers: list[nn.Module]) -> None:
    """Under FSDP2 the ranks train one model on slices of one batch, and an aux loss of this rank's statistics
    alone is not the whole batch's (the balance terms are products of batch means): refused, naming the call
    that sums them over every rank. (A plain DistributedDataParallel keeps the per-rank losses, as before.)"""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
            or torch.distributed.get_world_size() == 1 or all(m.experts.transport.stats is not None for m in layers):
        return
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing can be sharded by it
    if fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules()):
        raise MoespecError("moespec.aux_loss: this model is sharded by fully_shard, and its MoE layers' aux losses are "
                           "each rank's own, not those of the whole batch; lay it out with "
                           "moespec.distributed.parallelize(model, mesh, data='fsdp') (a mesh of (dp=world, ep=1) "
                           "shards every expert as fully_shard does), which sums the routing statistics over every "
                           "rank")

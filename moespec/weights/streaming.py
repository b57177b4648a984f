"""Streaming upcycling: from a dense checkpoint straight to a (sharded) safetensors checkpoint, one MoE layer at
a time, so that a model larger than memory can be upcycled (`moespec upcycle`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from ..backbones import device_memory
from ..choices import check_seed
from ..compiler import compile_model, materialize, moe_layers
from ..io import DEFAULT_MAX_SHARD_SIZE, TensorInfo, write_sharded
from ..planning import Plan
from ..planning.forward_cost import forward_cost_problem
from ..spec import Spec
from .checkpoint import load, output_dtype, spec_metadata
from .router_start import ImageSet
from .sources import Checkpoints, Sources
from .upcycle import (
    COMPARED_BATCH,
    COMPARED_IMAGES,
    RouterStart,
    UpcycleReport,
    caveats,
    compare,
    compared_inputs,
    compared_on,
    read_start,
    source_errors,
    start_routers,
    upcycle_layer,
)


def upcycle_to_checkpoint(spec: Spec, output: str | Path, *, checkpoint: Checkpoints = None,
                          images: ImageSet | Sequence[ImageSet] | None = None, seed: int = 0,
                          dtype: torch.dtype | None = None, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                          force: bool = False, check: bool = True, trust_pickle: bool = False,
                          on_layer: Callable[[str, int, int], None] | None = None,
                          on_batch: Callable[[str, int, int], None] | None = None,
                          on_skip: Callable[[str], None] | None = None,
                          ) -> tuple[list[Path], UpcycleReport | None]:
    """Upcycle `spec` straight into a (sharded) safetensors checkpoint at `output`, streaming.

    The MoE layers are built on the meta device; while the shards are written, each layer is materialized,
    filled from the dense FFNs, written and freed, so peak memory is the base dense model, every source's FFNs
    and one MoE layer. Weights equal `upcycle(spec, checkpoint, images=images, seed=seed)`'s (cast to `dtype`).
    The check compares the logits of the written model, loaded back, with the base dense model's (dense weights
    rounded to `dtype` too) and each source's, when the MoE model takes at most a quarter of this machine's
    memory and a forward at the spec's input size fits (`planning.forward_cost`), else each MoE layer against its
    base dense FFN as it is built (on a few tokens, whatever the input size). `on_layer(path, done, total)` is
    called as each MoE layer starts (`done`: the layers written so far), and `on_layer("", total, total)` after
    the last; `on_batch` likewise for the batches of images that start routers from data, and `on_skip(line)`
    hears of the unreadable image files they skipped.
    Returns the files written (index first) and the check's report (None without `check`).
    """
    check_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # fresh inits (dense model without weights, rebuilt blocks) are reproducible
        generator = torch.Generator().manual_seed(seed)
        sources, plan, sets = read_start(spec, checkpoint, images, seed=seed, trust_pickle=trust_pickle)
        dense = sources.base
        model = compile_model(dense, plan, moe_device="meta")  # shares every other module with `dense`
        start = start_routers(spec, plan, sources, moe_layers(model), sets, seed=seed, on_batch=on_batch,
                              on_skip=on_skip)
        state = model.state_dict()
        params = sum(t.numel() for t in state.values())
        batch = COMPARED_IMAGES if sets else COMPARED_BATCH
        whole = check and params * 4 <= _memory_bytes() / 4 and forward_cost_problem(
            spec, plan.input_size, batch=batch, runner="a check") is None
        layers = _LayerStream(model, spec, plan, sources, start, generator, per_layer_check=check and not whole,
                              on_layer=on_layer)
        infos = [TensorInfo(name, tuple(t.shape), output_dtype(t.dtype, dtype)) for name, t in state.items()]
        files = write_sharded(output, infos, lambda info: layers.tensor(info.name, state).to(info.dtype),
                              spec_metadata(spec), max_shard_size=max_shard_size, force=force)
    if not check:
        return files, None
    fields = start.report_fields(spec, sources, (), "")
    if whole:
        if dtype is not None:  # compare like with like: the dense weights rounded as the experts were
            dense.to(dtype).float()
        written = load(output)
        x = compared_inputs(sets, plan, dense, spec)
        x = torch.randn((COMPARED_BATCH, *plan.input_size), generator=torch.Generator().manual_seed(seed + 1)
                        ) if x is None else x
        report = compare(dense, written, plan.input_size, sources.names[0] if sources.count == 1 else
                         sources.base_label(), generator, inputs=x)
        errors = source_errors(written, spec, sources, x, seed=seed, trust_pickle=trust_pickle)
        fields = start.report_fields(spec, sources, errors, compared_on(sets, x))
    else:
        report = UpcycleReport(sources.names[0] if sources.count == 1 else sources.base_label(), layers.max_diff,
                               layers.max_output, scope="layers")
    return files, dataclasses.replace(report, caveats=caveats(plan) + start.caveats(spec, plan), **fields)


class _LayerStream:
    """Hands out the tensors of a model whose MoE layers are on the meta device: each layer is materialized
    and upcycled when its first tensor is asked for, and freed after its last."""

    def __init__(self, model: nn.Module, spec: Spec, plan: Plan, sources: Sources, start: RouterStart,
                 generator: torch.Generator, *, per_layer_check: bool,
                 on_layer: Callable[[str, int, int], None] | None):
        self.layers, self.spec, self.plan = moe_layers(model), spec, plan
        self.sources, self.start = sources, start  # the dense FFNs of every source, and where each expert's is
        self.generator, self.per_layer_check, self.on_layer = generator, per_layer_check, on_layer
        self.check_generator = torch.Generator().manual_seed(generator.initial_seed() + 1)
        self.current: tuple[str, dict[str, torch.Tensor]] | None = None
        self.done = 0
        self.max_diff = self.max_output = 0.0
        names = list(model.state_dict())
        self.owner = {name: path for name in names for path in self.layers if name.startswith(path + ".")}
        # state-dict order: a layer's names are contiguous, so its last name is where it can be freed
        self.last = {path: name for name, path in self.owner.items()}

    def tensor(self, name: str, state: dict[str, torch.Tensor]) -> torch.Tensor:
        path = self.owner.get(name)
        if path is None:
            return state[name]
        if self.current is None or self.current[0] != path:
            if self.on_layer is not None:
                self.on_layer(path, self.done, len(self.layers))
            self.current = (path, self._build(path))
        tensor = self.current[1][name[len(path) + 1:]]
        if name == self.last[path]:
            self.layers[path].to_empty(device="meta")  # free it: the next layer reuses the memory
            self.current = None
            self.done += 1
            if self.on_layer is not None and self.done == len(self.layers):
                self.on_layer("", self.done, self.done)
        return tensor

    def _build(self, path: str) -> dict[str, torch.Tensor]:
        layer = materialize(self.layers[path])  # fresh init: what rebuilt (rescaled) blocks keep
        if path in self.start.experts_from:  # not in a rebuilt block
            with torch.no_grad():
                upcycle_layer(layer, self.plan.layer(path), [ffns[path] for ffns in self.sources.ffns], self.spec,
                              self.generator, experts_from=self.start.experts_from[path],
                              base_ffn=self.sources.base_ffns[path], rows=self.start.rows.get(path))
            if self.per_layer_check:
                self._check(self.sources.base.get_submodule(path), layer)
        return layer.state_dict()

    @torch.no_grad()
    def _check(self, ffn: nn.Module, layer: nn.Module) -> None:
        """Max |MoE layer - dense FFN| on random items: [2, 16, C] tokens, or a [2, C, 4, 4] map."""
        dim = layer.experts.in_features
        shape = (2, dim, 4, 4) if layer.channels_dim == 1 else (2, 16, dim)
        x = torch.randn(shape, generator=self.check_generator)
        dense_y, moe_y = ffn.eval()(x), layer.eval()(x)
        self.max_diff = max(self.max_diff, (dense_y - moe_y).abs().max().item())
        self.max_output = max(self.max_output, dense_y.abs().max().item())


def _memory_bytes() -> int:
    return device_memory(torch.device("cpu"))

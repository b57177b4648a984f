"""Routers started from data (`upcycle.router_init: hidden | kmeans`): one pass of the base dense model over the
images, recording at each planned FFN the vectors its MoE layer's router will score (the FFN's input through
the FFN's own `pre` module, pooled per image where the router routes images), folded into bounded state as
they come:

    hidden   per source, the running mean of the router inputs over that source's images; expert i's row points
             along the mean of its source's (mergekit-moe's `gate_mode: hidden`, which uses the base model too)
    kmeans   a streaming k-means of the router inputs of all the images (mini-batch k-means with per-centroid
             rates, Sculley 2010, seeded k-means++ on the first items); row i is centroid i (cluster-aware
             upcycling). Spherical (on unit vectors) for gates that score by dot product or cosine, Euclidean
             for an L2 gate.

Memory: one batch of images and its activations, plus per layer a [sources, C] or [E, C] state. The result
depends only on the images (in order: a folder is read sorted by path), the seed and the weights.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Callable, Iterator, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..backbones import adapter_named
from ..backbones.images import data_transform, image_files, read_images
from ..errors import MoespecError, SpecError
from ..layers import MoELayer
from ..planning import Plan
from ..planning.forward_cost import refuse_costly_forward
from ..spec import Spec, spec_problem

ImageSet = Union[torch.Tensor, str, Path]
"""A batch of images [B, C, H, W] at the spec's input size, already normalized as the model expects, or a
folder of image files (read with the model's timm eval transform, subfolders too, sorted by path)."""

BATCH = 16
"""Images per forward of the pass."""


def image_sets(images: ImageSet | Sequence[ImageSet] | None) -> list[ImageSet]:
    """`upcycle`'s `images` argument as a list of sets (one per source for `hidden`)."""
    if images is None:
        return []
    if isinstance(images, (torch.Tensor, str, Path)):
        return [images]
    return list(images)


def check_image_sets(spec: Spec, sets: list[ImageSet], sources: int) -> None:
    """What `router_init` needs: `hidden` one set per source (and two sources or more), `kmeans` at least one."""
    mode = spec.upcycle.router_init
    field = "upcycle.router_init"
    if mode == "hidden":
        if sources < 2:
            raise SpecError(spec_problem(spec, field, "hidden points each expert's row along the mean input of its "
                                         "source's images, so one source gives every row the same direction; give "
                                         "several checkpoints, or use kmeans to start the rows from one image set"))
        if len(sets) != sources:
            raise SpecError(spec_problem(spec, field, f"hidden needs one image folder or batch per source: "
                                         f"{sources} sources, {len(sets)} image set(s) given (--images DIR once "
                                         f"per source, in the sources' order)"))
    elif mode == "kmeans" and not sets:
        raise SpecError(spec_problem(spec, field, "kmeans needs images: an image folder or batch (--images DIR)"))


class Batches:
    """The batches of one image set, read as they are needed: a tensor is cut into `BATCH`-image batches, a
    folder is read `BATCH` files at a time. Unreadable files are skipped and listed in `skipped`."""

    def __init__(self, images: ImageSet, index: int, model: nn.Module, spec: Spec, input_size: tuple[int, int, int]):
        self.images, self.index, self.skipped = images, index, []
        self.input_size = tuple(input_size)
        if isinstance(images, torch.Tensor):
            if images.dim() != 4 or tuple(images.shape[1:]) != self.input_size or not images.is_floating_point():
                raise MoespecError(f"images[{index}]: expected a float batch [B, {', '.join(map(str, input_size))}] "
                                   f"at the spec's input_size, got {images.dtype} {list(images.shape)}")
            if images.shape[0] == 0:
                raise MoespecError(f"images[{index}]: the batch holds no images")
            self.count = images.shape[0]
        else:
            self.files = image_files(images)
            self.count = len(self.files)
            self.transform = data_transform(model, self.input_size, spec.source or spec.name or "the spec")[1]
        self.read = 0

    def skipped_line(self) -> str | None:
        """What the pass skipped, in one line (None: nothing)."""
        if not self.skipped:
            return None
        return (f"upcycle: skipped {len(self.skipped)} of {self.count} files in {self.images} that are not readable "
                f"images (first: {self.skipped[0]})")

    @property
    def label(self) -> str:
        return f"images[{self.index}]" if isinstance(self.images, torch.Tensor) else str(self.images)

    def __len__(self) -> int:
        return math.ceil(self.count / BATCH)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for start in range(0, self.count, BATCH):
            if isinstance(self.images, torch.Tensor):
                batch = self.images[start:start + BATCH].float()
            else:
                read = read_images(self.files[start:start + BATCH], self.transform, self.input_size[0],
                                   self.skipped, purpose="upcycle")
                if not read:
                    continue
                batch = torch.stack([tensor for _, tensor in read])
            self.read += batch.shape[0]
            yield batch
        if not self.read:
            first = f"; first: {self.skipped[0]}" if self.skipped else ""
            raise MoespecError(f"{self.label}: no readable images ({len(self.skipped)} file(s) could not be read"
                               f"{first})")


class RunningMean:
    """The mean of the vectors of each image set, as a float64 running sum and count."""

    def __init__(self, sets: int, dim: int):
        self.sums = torch.zeros(sets, dim, dtype=torch.float64)
        self.counts = torch.zeros(sets, dtype=torch.float64)

    def add(self, index: int, vectors: torch.Tensor) -> None:
        self.sums[index] += vectors.double().sum(dim=0)
        self.counts[index] += vectors.shape[0]

    def means(self) -> torch.Tensor:
        return (self.sums / self.counts.clamp(min=1).unsqueeze(1)).float()


class StreamingKMeans:
    """k-means over a stream of vectors in bounded memory (mini-batch k-means, Sculley 2010): the first k or more
    vectors seed the centroids by k-means++ (drawn from `generator`); then each batch assigns every vector to
    its nearest centroid, and each centroid moves to the running mean of all the vectors assigned to it so far
    (rate 1 / count). `spherical`: vectors and centroids are compared as unit vectors (cosine), for gates that
    score by dot product or cosine."""

    def __init__(self, k: int, generator: torch.Generator, spherical: bool):
        self.k, self.generator, self.spherical = k, generator, spherical
        self.centroids: torch.Tensor | None = None
        self.counts = torch.zeros(k, dtype=torch.float64)
        self.pending: list[torch.Tensor] = []

    def add(self, index: int, vectors: torch.Tensor) -> None:
        x = vectors.double()
        if self.spherical:
            x = F.normalize(x, dim=-1)
        if self.centroids is None:
            self.pending.append(x)
            if sum(p.shape[0] for p in self.pending) < self.k:
                return
            x, self.pending = torch.cat(self.pending), []
            self.centroids = self._seed(x)
        assigned = self._nearest(x)
        sizes = torch.bincount(assigned, minlength=self.k).double()
        sums = torch.zeros_like(self.centroids).index_add_(0, assigned, x)
        self.counts += sizes
        moved = sizes > 0
        self.centroids[moved] += (sums[moved] - sizes[moved, None] * self.centroids[moved]) / self.counts[moved, None]

    def _nearest(self, x: torch.Tensor) -> torch.Tensor:
        centroids = F.normalize(self.centroids, dim=-1) if self.spherical else self.centroids
        return torch.cdist(x, centroids).argmin(dim=1)

    def _seed(self, x: torch.Tensor) -> torch.Tensor:
        """k-means++ (Arthur and Vassilvitskii 2007): each next seed drawn with probability ~ its squared distance
        to the nearest seed so far (uniformly where every vector sits on a seed)."""
        chosen = [int(torch.randint(x.shape[0], (1,), generator=self.generator))]
        nearest = torch.cdist(x, x[chosen[-1]].unsqueeze(0)).squeeze(1) ** 2
        for _ in range(1, self.k):
            weights = nearest if nearest.sum() > 0 else torch.ones_like(nearest)
            chosen.append(int(torch.multinomial(weights, 1, generator=self.generator)))
            nearest = torch.minimum(nearest, torch.cdist(x, x[chosen[-1]].unsqueeze(0)).squeeze(1) ** 2)
        return x[chosen].clone()

    def result(self, what: str) -> torch.Tensor:
        if self.centroids is None:
            seen = sum(p.shape[0] for p in self.pending)
            raise MoespecError(f"{what}: k-means of {self.k} centroids needs at least {self.k} router inputs, the "
                               f"images gave {seen}; give more images")
        return (F.normalize(self.centroids, dim=-1) if self.spherical else self.centroids).float()


@torch.no_grad()
def router_rows(spec: Spec, plan: Plan, base: nn.Module, layers: dict[str, MoELayer], sets: list[ImageSet],
                experts_from: dict[str, tuple[int, ...]], seed: int,
                on_batch: Callable[[str, int, int], None] | None = None,
                on_skip: Callable[[str], None] | None = None) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Each started layer's rows [E, C] (`hidden` or `kmeans`, from one pass of `base` over `sets`), and the
    images read from each set. `layers` are the MoE layers (on any device, the meta device too: only their
    routers' pooling is used); `experts_from[path]` is each expert's source. `on_skip(line)` is told, per image
    folder, what unreadable files were passed over (default: a Python warning)."""
    mode = spec.upcycle.router_init
    paths = [layer.path for layer in plan.layers if plan.rebuilt(layer.path) is None]
    batches = [Batches(images, i, base, spec, plan.input_size) for i, images in enumerate(sets)]
    refuse_costly_forward(spec, plan.input_size, f"reading images for router_init: {mode}", batch=BATCH,
                          runner="a batch", hint="use a smaller input size")
    generator = torch.Generator().manual_seed(seed)
    folds: dict[str, RunningMean | StreamingKMeans] = {}
    for path in paths:
        dim = layers[path].experts.in_features
        if mode == "hidden":
            folds[path] = RunningMean(len(sets), dim)
        else:
            folds[path] = StreamingKMeans(plan.layer(path).num_experts, generator,
                                          spherical=layers[path].gate_router().row_metric() != "l2")
    current = [0]  # the image set of the batch in flight

    def record(path: str, pre: nn.Module | None, args: tuple) -> None:
        x = args[0] if pre is None else pre(args[0])
        folds[path].add(current[0], layers[path].gate_input(x).detach())

    hooks = []
    for path in paths:
        ffn = base.get_submodule(path)
        pre = adapter_named(plan.layer(path).family).pre_module(ffn)
        hooks.append(ffn.register_forward_pre_hook(
            lambda module, args, path=path, pre=pre: record(path, None if pre is None else pre.eval(), args)))
    total, done = sum(len(b) for b in batches), 0
    training = base.training
    base.eval()
    try:
        for index, batch_set in enumerate(batches):
            current[0] = index
            for batch in batch_set:
                if on_batch is not None:
                    on_batch(batch_set.label, done, total)
                base(batch)
                done += 1
            line = batch_set.skipped_line()
            if line is not None and on_skip is not None:
                on_skip(line)
            elif line is not None:
                warnings.warn(line, stacklevel=2)
    finally:
        base.train(training)
        for hook in hooks:
            hook.remove()
    if on_batch is not None:
        on_batch("", total, total)
    rows = {}
    for path, fold in folds.items():
        if isinstance(fold, RunningMean):
            means = fold.means()
            rows[path] = means[list(experts_from[path])]
        else:
            rows[path] = fold.result(path)
    return rows, [b.read for b in batches]


def describe_start(spec: Spec, images: Sequence[int]) -> str:
    """How the routers started, for the report; `images`: the images read from each set."""
    mode = spec.upcycle.router_init
    if mode == "normal":
        return "N(0, 0.02^2)"
    if mode == "zeros":
        return "zeros"
    if mode == "hidden":
        counts = ", ".join(f"{n} for source {i}" for i, n in enumerate(images))
        return f"hidden: each row along the mean router input of its source's images ({counts})"
    return f"kmeans: rows at the k-means centroids of the router inputs of {sum(images)} images"

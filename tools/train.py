"""Train a moespec spec on an ImageFolder (or synthetic images), on one process or on several under torchrun.

    python tools/train.py SPEC [--data DIR] [--steps N | --epochs N] [--output DIR] ...
    torchrun --standalone --nproc_per_node 8 tools/train.py SPEC --data DIR --batch-size 128 --output DIR ...
    torchrun --standalone --nproc_per_node 8 tools/train.py SPEC --ep 4 --data-parallel fsdp ...

Under torchrun (WORLD_SIZE set) the W ranks join one process group (NCCL on GPUs, gloo on CPUs) and the model
is laid out on a 2-D DeviceMesh of W/ep x ep ranks, dims ("dp", "ep"), by `moespec.distributed.parallelize`:
each rank of an `ep` row keeps E/ep experts of every MoE layer (tokens reach them by all_to_all), the experts
are replicated over `dp` (their gradients averaged over it), and the rest of the model is data-parallel over
all W ranks: DistributedDataParallel (`--data-parallel ddp`, the default) or FSDP2's fully_shard per block and
root (`--data-parallel fsdp`, the experts then FSDP-sharded over `dp`). `--ep` defaults to W: every rank holds
E/W experts and nothing is replicated, the layout of shard_experts + DDP. It must divide W and every layer's
experts. Every rank has the same global weights (from --seed or the checkpoint): a fresh model is built whole
and each rank keeps its part; with ep > 1, `--init load` and `--init upcycle` read or build only the rank's
experts (`moespec.distributed.load` / `upcycle` over its ep row). `--batch-size` is per rank: every rank
trains its own slice of the global batch. Run plainly, it trains one unsharded model in one process.

Each step: cross-entropy + `moespec.aux_loss(model)` (global statistics under expert parallelism), backward,
`moespec.distributed.clip_grad_norm_` with `--clip-grad` (the norm over every rank's experts), AdamW from
timm's `create_optimizer_v2` over `moespec.optimizer_groups` (timm's groups: no weight decay on 1-D parameters
and `no_weight_decay()` names; the routed experts at `--expert-weight-decay`), linear warmup then cosine decay,
bfloat16 autocast on GPUs. Routers with `bias_balance` (DeepSeek-V3's aux-loss-free balancing) move their bias
once per step from that step's loads (`moespec.update_bias`, global under expert parallelism).

`--output DIR` receives DIR/state (model + optimizer + step + scheduler, `moespec.distributed.save_state`:
resumable at any world size and mesh) every `--save-every` steps and at the end, and DIR/model.safetensors at
the end (`moespec.save`: the one-process format, loadable by `moespec.load` at any world size). `--resume DIR`
(that output folder, or its state folder) continues where the state left off; the data order is the same as
without the interruption when the world size and batch size are.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from timm.data import ImageDataset, create_transform, resolve_data_config
from timm.optim import create_optimizer_v2
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import moespec
import moespec.distributed as md
from moespec import MoespecError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path, help="spec YAML")
    data = parser.add_argument_group("data")
    data.add_argument("--data", type=Path, help="ImageFolder (DIR/CLASS/IMAGE); default: synthetic images")
    data.add_argument("--synthetic-size", type=int, default=512, help="synthetic images (default: %(default)s)")
    data.add_argument("--batch-size", type=int, default=32, help="images per rank and step (default: %(default)s)")
    data.add_argument("--workers", type=int, help="data loader processes per rank (default: 4, 0 for synthetic)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=int, help="passes over the data (default: 1 without --steps)")
    length.add_argument("--steps", type=int, help="optimizer steps in all")
    optim = parser.add_argument_group("optimization")
    optim.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: %(default)s)")
    optim.add_argument("--weight-decay", type=float, default=0.05, help="AdamW's (default: %(default)s)")
    optim.add_argument("--expert-weight-decay", type=float,
                       help="the routed experts' weight decay (default: --weight-decay's)")
    optim.add_argument("--warmup-steps", type=int, default=0,
                       help="linear warmup steps, then a cosine to 0 (default: %(default)s)")
    optim.add_argument("--clip-grad", type=float, help="clip the global gradient norm to this")
    optim.add_argument("--seed", type=int, default=0,
                       help="model init (the same on every rank), data order, dropout (default: %(default)s)")
    init = parser.add_argument_group("weights")
    init.add_argument("--init", choices=("fresh", "upcycle", "load"), default="fresh",
                      help="fresh (default): timm's init; upcycle: experts copied from a dense --checkpoint "
                           "(default: the spec's backbone source); load: a moespec --checkpoint of this spec")
    init.add_argument("--checkpoint", type=Path, help="dense checkpoint (upcycle) or moespec checkpoint (load)")
    out = parser.add_argument_group("checkpoints and logs")
    out.add_argument("--output", type=Path, help="folder for state/ and model.safetensors (default: --resume's, "
                                                 "else nothing is saved)")
    out.add_argument("--resume", type=Path, help="an --output folder (or its state/) to continue from")
    out.add_argument("--save-every", type=int, default=0, help="save the state every N steps (default: at the end)")
    out.add_argument("--log-every", type=int, default=10, help="log every N steps (default: %(default)s)")
    out.add_argument("--dist-timeout", type=int, default=1800,
                     help="seconds a collective waits for the other ranks (default: %(default)s)")
    mesh = parser.add_argument_group("parallelism (under torchrun: a dp x ep mesh of the ranks)")
    mesh.add_argument("--ep", type=int, help="expert-parallel ranks: each keeps E/ep experts of every MoE layer, "
                                             "the experts replicated over the other W/ep (default: every rank)")
    mesh.add_argument("--data-parallel", choices=md.parallel.DATA,
                      help="the rest of the model over every rank: ddp (DistributedDataParallel, the default) or "
                           "fsdp (FSDP2's fully_shard per block and root; the experts sharded over dp)")
    args = parser.parse_args(argv)
    world = os.environ.get("WORLD_SIZE")
    if world is None and (args.ep is not None or args.data_parallel is not None):
        parser.error("--ep and --data-parallel lay the model out over torchrun's ranks: run the script under "
                     "torchrun (WORLD_SIZE is not set)")
    if args.ep is not None and not (args.ep >= 1 and int(world) % args.ep == 0):
        divisors = ", ".join(str(d) for d in range(1, int(world) + 1) if int(world) % d == 0)
        parser.error(f"--ep {args.ep} must divide the number of ranks, {world} (dp = ranks / ep): one of {divisors}")
    args.data_parallel = args.data_parallel or "ddp"
    if args.init == "load" and args.checkpoint is None:
        parser.error("--init load needs --checkpoint (a moespec checkpoint)")
    if args.init == "fresh" and args.checkpoint is not None:
        parser.error("--checkpoint is for --init upcycle or --init load")
    if args.expert_weight_decay is not None and not args.expert_weight_decay >= 0:
        parser.error(f"--expert-weight-decay must be >= 0, got {args.expert_weight_decay}")
    if args.output is None and args.resume is not None:
        args.output = args.resume if (args.resume / "state").is_dir() else args.resume.parent
    return args


def setup_distributed(timeout_s: int) -> tuple[int, int, torch.device]:
    """(rank, world, device). Under torchrun (WORLD_SIZE set) joins the process group: NCCL with one GPU per
    rank, gloo on CPUs. Run plainly: rank 0 of 1, nothing initialized."""
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" not in os.environ:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def build_mesh(args: argparse.Namespace, spec, world: int, device: torch.device) -> DeviceMesh | None:
    """Under torchrun: the (W/ep, ep) mesh of the ranks, dims ("dp", "ep"), once --ep is checked against every
    MoE layer's experts (from the spec's plan, on the meta device: before any weight is read). Run plainly: None."""
    if not dist.is_initialized():
        return None
    ep = args.ep or world
    experts = sorted({layer.num_experts for layer in moespec.plan(spec).layers})
    if any(count % ep for count in experts):
        fits = [d for d in range(1, world + 1) if world % d == 0 and all(count % d == 0 for count in experts)]
        given = f"--ep {ep}" if args.ep else f"--ep (default: every rank, {ep})"
        raise MoespecError(f"{given}: the MoE layers' {' and '.join(map(str, experts))} experts do not split evenly "
                           f"over {ep} expert-parallel ranks; --ep must divide every layer's experts and the {world} "
                           f"ranks: one of {', '.join(map(str, fits))}")
    return init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("dp", "ep"))


def build_model(args: argparse.Namespace, spec, device: torch.device, mesh: DeviceMesh | None) -> nn.Module:
    """The spec's model (fresh, upcycled or loaded) on `device`, the same global weights on every rank. Loaded or
    upcycled on a mesh with ep > 1, each rank reads or builds only its experts, sharded over its ep row (which
    `parallelize` keeps); otherwise it is whole, and `parallelize` keeps this rank's part."""
    group = mesh["ep"].get_group() if mesh is not None and mesh["ep"].size() > 1 else None
    if args.init == "load":
        model = md.load(args.checkpoint, group=group, device=device) if group is not None \
            else moespec.load(args.checkpoint, device=device)
        if model.moespec_spec.to_yaml() != spec.to_yaml():
            raise MoespecError(f"{args.checkpoint}: holds the model of another spec than {args.spec} "
                               f"(its spec is {model.moespec_spec.name!r}); pass the spec it was saved with")
    elif args.init == "upcycle":
        model = md.upcycle(spec, args.checkpoint, seed=args.seed, group=group) if group is not None \
            else moespec.upcycle(spec, args.checkpoint, seed=args.seed)
    else:
        model = moespec.create_model(spec, seed=args.seed)
    return model.to(device).train()


def lay_out(model: nn.Module, args: argparse.Namespace, mesh: DeviceMesh | None) -> tuple[nn.Module, str]:
    """(the module to call, the layout in words): `model` laid out in place on `mesh` by `parallelize` (a DDP
    wrapper for ddp, the model itself for fsdp), or as it is when run plainly."""
    device = next(model.parameters()).device
    if mesh is None:
        return model, f"1 process on {device.type}"
    net = md.parallelize(model, mesh, data=args.data_parallel)
    dp, ep = mesh["dp"].size(), mesh["ep"].size()
    return net, f"{dp * ep} rank(s) on {device.type}, dp {dp} x ep {ep}, {args.data_parallel}"


class SyntheticImages(Dataset):
    """`size` random images of shape `input_size` with random labels; each label adds its own fixed pattern
    to the noise, so that there is something to learn. Item i is the same on every rank and every call."""

    def __init__(self, size: int, input_size: tuple[int, int, int], num_classes: int, seed: int = 0):
        self.size, self.input_size, self.seed = size, tuple(input_size), seed
        self.labels = torch.randint(num_classes, (size,), generator=_generator(seed, 0))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = int(self.labels[index])
        pattern = torch.randn(self.input_size, generator=_generator(self.seed, 1, label))
        noise = torch.randn(self.input_size, generator=_generator(self.seed, 2, index))
        return noise + pattern, label


def _generator(*key: int) -> torch.Generator:
    """A generator seeded by a tuple of ints (Python hashes int tuples the same in every process)."""
    return torch.Generator().manual_seed(hash(key) & (2**63 - 1))


def build_dataset(args: argparse.Namespace, model: nn.Module) -> Dataset:
    """The ImageFolder at `--data` through timm's training transform at the spec's input size, or synthetic
    images of that size."""
    input_size = tuple(moespec.plan_of(model).input_size)
    if args.data is None:
        return SyntheticImages(args.synthetic_size, input_size, model.num_classes, seed=args.seed)
    if not args.data.is_dir():
        raise MoespecError(f"--data {args.data}: no such folder (an ImageFolder: DIR/CLASS/IMAGE)")
    config = resolve_data_config({"input_size": input_size}, model=model)
    dataset = ImageDataset(str(args.data), transform=create_transform(**config, is_training=True))
    classes = len(dataset.reader.class_to_idx)
    if classes != model.num_classes:
        raise MoespecError(f"--data {args.data}: {classes} classes, but the model has {model.num_classes} outputs; "
                           f"set backbone.kwargs.num_classes: {classes} in {args.spec}")
    return dataset


def cosine_with_warmup(warmup: int, total: int):
    """The LR factor of step s: linear from 1/warmup to 1 over `warmup` steps, then a cosine to 0 at `total`."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


def global_mean(values: list[torch.Tensor]) -> list[float]:
    """The mean over the ranks of each scalar (a collective under torch.distributed)."""
    stacked = torch.stack([v.detach().float() for v in values])
    if dist.is_initialized():
        dist.all_reduce(stacked)  # SUM: gloo has no AVG
        stacked /= dist.get_world_size()
    return stacked.tolist()


def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW over timm's parameter groups, the routed experts at --expert-weight-decay."""
    groups = moespec.optimizer_groups(model, args.weight_decay, expert_weight_decay=args.expert_weight_decay)
    return create_optimizer_v2(groups, "adamw", lr=args.lr, weight_decay=args.weight_decay)


def save(output: Path, model: nn.Module, optimizer, scheduler, step: int, final: bool) -> None:
    """The training state (every rank writes its part), and at the end the model in the one-process format."""
    md.save_state(output / "state", model, optimizer, extra={"step": step, "scheduler": scheduler.state_dict()})
    if final:
        moespec.save(model, output / "model.safetensors", force=True)


def resume_from(path: Path, model: nn.Module, optimizer, scheduler) -> int:
    """Load model, optimizer and scheduler from a `save` folder (an --output folder or its state/); the step."""
    state = path / "state" if (path / "state").is_dir() else path
    extra = md.load_state(state, model, optimizer)
    saved_by_train = isinstance(extra, dict) and isinstance(extra.get("scheduler"), dict)
    if not (saved_by_train and isinstance(extra.get("step"), int)):
        raise MoespecError(f"{state}: not a state that tools/train.py saved (its extra.json has no step and "
                           f"scheduler); resume from an --output folder of this script")
    scheduler.load_state_dict(extra["scheduler"])
    step = extra["step"]
    # the learning rate of this run's schedule at `step` (with a new --steps, the cosine of the new length)
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(step)
    return step


def progress_bar(enabled: bool) -> Progress:
    """A rich bar on stderr on rank 0 when stderr is a terminal; log lines print above it."""
    return Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True),
                    disable=not (enabled and sys.stderr.isatty()))


def train(args: argparse.Namespace) -> None:
    rank, world, device = setup_distributed(args.dist_timeout)
    torch.manual_seed(args.seed + rank)  # dropout and router noise differ per rank; weights come from --seed
    spec = moespec.load_spec(args.spec)
    mesh = build_mesh(args, spec, world, device)
    model = build_model(args, spec, device, mesh)
    net, layout = lay_out(model, args, mesh)  # `model` is the same module, its experts this rank's
    dataset = build_dataset(args, model)
    # drop_last: every rank gets as many full batches of the same size (Soft MoE's even exchange needs it)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    steps_per_epoch = len(sampler) // args.batch_size
    if steps_per_epoch == 0:
        raise MoespecError(f"{len(dataset)} images make no full batch of {args.batch_size} on each of {world} "
                           f"rank(s); lower --batch-size or add images")
    total = args.steps if args.steps is not None else (args.epochs or 1) * steps_per_epoch

    optimizer = build_optimizer(model, args)  # the laid-out parameters (FSDP2's DTensors under fsdp)
    scheduler = LambdaLR(optimizer, cosine_with_warmup(args.warmup_steps, total))
    step = resume_from(args.resume, model, optimizer, scheduler) if args.resume else 0
    workers = args.workers if args.workers is not None else (0 if args.data is None else 4)
    main = rank == 0
    if main:
        print(f"{model.moespec_spec.name}: {layout}, {args.batch_size} images per rank, "
              f"{steps_per_epoch} steps per epoch, steps {step} -> {total}"
              + (f" (resumed from {args.resume})" if args.resume else ""), flush=True)

    seen, started, window_start, window_images = 0, time.perf_counter(), time.perf_counter(), 0
    task_value = aux_value = float("nan")
    with progress_bar(main) as bar:
        bar_task = bar.add_task("train", total=total, completed=step)
        while step < total:
            epoch, skip = divmod(step, steps_per_epoch)
            sampler.set_epoch(epoch)
            indices = list(sampler)[skip * args.batch_size:]  # resuming mid-epoch: the batches not yet seen
            loader = DataLoader(dataset, batch_size=args.batch_size, sampler=indices, drop_last=True,
                                num_workers=workers, pin_memory=device.type == "cuda")
            for images, labels in loader:
                images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    task = F.cross_entropy(net(images), labels)
                aux = moespec.aux_loss(model).to(task.device)
                lr = optimizer.param_groups[0]["lr"]
                optimizer.zero_grad(set_to_none=True)
                (task + aux).backward()
                if args.clip_grad is not None:
                    md.clip_grad_norm_(model, args.clip_grad)
                moespec.update_bias(model)  # routers with bias_balance: this step's loads (global under EP)
                optimizer.step()
                scheduler.step()
                step += 1
                seen += images.shape[0] * world
                window_images += images.shape[0] * world
                bar.update(bar_task, completed=step)
                if step % args.log_every == 0 or step == total:
                    task_value, aux_value = global_mean([task, aux])
                    now = time.perf_counter()
                    if main:
                        print(f"step {step}/{total}  loss {task_value + aux_value:.4f}  aux {aux_value:.4f}  "
                              f"lr {lr:.2e}  {window_images / (now - window_start):.1f} "
                              f"img/s", flush=True)
                    window_start, window_images = now, 0
                if args.output is not None and args.save_every and step % args.save_every == 0 and step < total:
                    save(args.output, model, optimizer, scheduler, step, final=False)
                if step == total:
                    break
    elapsed = time.perf_counter() - started
    if args.output is not None:
        save(args.output, model, optimizer, scheduler, step, final=True)
    if main:
        saved = f"; saved {args.output / 'state'} and {args.output / 'model.safetensors'}" if args.output else ""
        ran = (f"{seen} images in {elapsed:.1f} s ({seen / elapsed:.1f} img/s over {world} rank(s)), last loss "
               f"{task_value + aux_value:.4f} (aux {aux_value:.4f})" if seen else "no steps left to run")
        print(f"done: step {step}/{total}, {ran}{saved}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        train(args)
    except MoespecError as error:  # a user mistake: one line, exit 2 (torchrun stops the other ranks)
        print(f"train.py: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

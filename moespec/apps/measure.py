"""The commands `moespec bench` (throughput, MoE beside dense: `apps/bench.py`) and `moespec eval` (accuracy over an
ImageFolder: `apps/evaluate.py`). Registered on the CLI's app by `register`; torch is imported inside the command
bodies (`moespec --help` does not pay for it)."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Callable, List, Optional, Tuple

import typer

from ..errors import MoespecError
from . import terminal
from .options import Format

BenchDType = Enum("BenchDType", {"fp32": "fp32", "bf16": "bf16"}, type=str)
EvalFormat = Enum("EvalFormat", {"table": "table", "json": "json"}, type=str)
Device = Annotated[str, typer.Option("--device", help="Where the models run: cpu, cuda, cuda:N.")]
SpecOption = Annotated[Optional[Path], typer.Option(
    "--spec", help="The spec of a checkpoint without one inside (a timm training checkpoint, .pth.tar).")]


def _existing(paths: List[Path]) -> None:
    """Every path given is there (checked before torch is imported)."""
    for path in paths:
        if not path.exists():
            raise MoespecError(f"{path}: no such spec, checkpoint or folder")


def _checked_device(device: str) -> None:
    """A device this machine has, or one line naming `--device` (before any model is built)."""
    from ..backbones import resolve_device

    try:
        resolve_device(device)
    except MoespecError as error:
        raise MoespecError(f"--device {device}: {error}".replace("use device='cpu'", "use --device cpu")) from None
    if device == "meta":
        raise MoespecError("--device meta: a model on the meta device has no storage to run; use cpu or cuda")


def register(app: typer.Typer, run: Callable[[Callable[[], None]], None], out, quiet: Callable[[], bool]) -> None:
    """Add the two commands to `app`; `run` turns user mistakes into one line and exit 2 (`cli._run`), `quiet`
    says whether `--quiet` was given."""

    @app.command("bench")
    def bench_command(
        sources: Annotated[List[Path], typer.Argument(
            help="Specs (built with a seeded random init) or moespec checkpoints (.safetensors, sharded index, Hub "
                 "folder).")],
        device: Device = "cpu",
        batch: Annotated[int, typer.Option("--batch", min=1, help="Images per step.")] = 32,
        dtype: Annotated[BenchDType, typer.Option(
            "--dtype", help="fp32, or bf16 autocast (weights in fp32, as timm's --amp).")] = BenchDType.fp32,
        train: Annotated[bool, typer.Option(
            "--train", help="Time a training step (forward, loss + aux, backward, AdamW step), not an eval "
                            "forward.")] = False,
        compile: Annotated[bool, typer.Option("--compile", help="torch.compile both models first.")] = False,
        rounds: Annotated[int, typer.Option("--rounds", min=1, help="Timed rounds (one step of each model).")] = 10,
        warmup: Annotated[int, typer.Option("--warmup", min=0, help="Untimed rounds first.")] = 2,
        seed: Annotated[int, typer.Option(help="Seed of the random init and the random images.")] = 0,
        format: Annotated[Format, typer.Option("--format", "-f", help="Output format.")] = Format.table,
    ) -> None:
        """Images/s of each MoE model and its dense backbone, timed interleaved; the ratio, GMACs and efficiency."""

        def body() -> None:
            _existing(sources)
            _checked_device(device)
            from .bench import bench, render

            with terminal.progress("timing", quiet()) as advance:
                report = bench(sources, device=device, batch=batch, dtype=dtype.value, train=train, compile=compile,
                               rounds=rounds, warmup=warmup, seed=seed, on_round=advance)
            sys.stdout.write(render(report, format.value))

        run(body)

    @app.command("eval")
    def eval_command(
        checkpoint: Annotated[Path, typer.Argument(
            help="A moespec checkpoint (.safetensors, sharded index), a Hub folder (moespec's or timm's), or with "
                 "--spec a timm training checkpoint.")],
        images: Annotated[Path, typer.Option("--images", metavar="DIR", help="Labelled images: one subfolder "
                                             "per class (ImageFolder), class i in natural order is logit i.")],
        batch: Annotated[int, typer.Option("--batch", min=1, help="Images per forward.")] = 32,
        device: Device = "cpu",
        input_size: Annotated[Optional[Tuple[int, int, int]], typer.Option(
            "--input-size", metavar="C H W", help="Evaluate at this size (default: the model's, as timm's "
                                                  "validate.py picks it).")] = None,
        per_class: Annotated[bool, typer.Option("--per-class", help="Each class's top-1 too.")] = False,
        format: Annotated[EvalFormat, typer.Option("--format", "-f", help="Output format.")] = EvalFormat.table,
        spec: SpecOption = None,
        ema: Annotated[bool, typer.Option("--ema", help="With --spec: the checkpoint's EMA weights.")] = False,
        trust_pickle: Annotated[bool, typer.Option(
            "--trust-pickle", help="Unpickle a training checkpoint's non-tensor state (trusted files only).")] = False,
    ) -> None:
        """Top-1 and top-5 accuracy and the loss over labelled images, with each MoE layer's expert load."""

        def body() -> None:
            _existing([checkpoint, images, *([spec] if spec else [])])
            _checked_device(device)
            from .evaluate import evaluate, load_classifier, render

            model = load_classifier(checkpoint, device=device, spec=spec, ema=ema, trust_pickle=trust_pickle)
            with terminal.progress("evaluating", quiet()) as advance:
                report = evaluate(model, images, batch_size=batch, input_size=input_size, source=str(checkpoint),
                                  on_batch=advance)
            for skipped in report.skipped[:5]:
                terminal.error(f"moespec: warning: skipped an unreadable image: {skipped}")
            if len(report.skipped) > 5:
                terminal.error(f"moespec: warning: skipped {len(report.skipped) - 5} more unreadable images")
            json_text = json.dumps(report.to_dict(), indent=2) + "\n"
            sys.stdout.write(json_text if format.value == "json" else render(report, per_class))

        run(body)

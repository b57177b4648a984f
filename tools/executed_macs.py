"""What a forward executes beside what `moespec stats` activates: docs/counting.md's "Executed" table.

    python tools/executed_macs.py [SPEC ...] [--batch 8] [--max-weights-gb 2]   # default: specs/*.yaml

Per image, in GMACs: `moespec stats`'s activated figure (fvcore's trace of the dense part, each MoE layer costed
under perfect balance) and its dense backbone's; then torch's FlopCounterMode (matmuls and convolutions only, no
norms) over an eval forward of a fresh model on `--batch` random images, the dense backbone, the CPU's eager
step (its expert step pads each expert's rows to the step's block, `layers/steps/`) and the GPU's sync-free step
run on CPU (`device_path()`: the grouped matmuls over the rows the routing sends, counted through the flop
formulas `layers/ops/grouped.py` registers); and the exported graph's (`tools/export_cost.py`: every expert on
every item). A fresh router's routing is near-uniform; a trained one's padding differs. Specs whose fp32 weights
exceed `--max-weights-gb` are left out (the Soft MoE H/14 and L/16 specs: 50-220 GB).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import moespec  # noqa: E402
from moespec.backbones import create_backbone  # noqa: E402
from moespec.counting import stats  # noqa: E402
from moespec.layers import device_path  # noqa: E402
from tools.export_cost import exported_gmacs  # noqa: E402


def counted(model: torch.nn.Module, x: torch.Tensor, gpu_path: bool = False) -> float:
    """GMACs per image FlopCounterMode counts in an eval forward of `model` on `x`."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        if gpu_path:
            with device_path():
                model(x)
        else:
            model(x)
    return counter.get_total_flops() / 2 / x.shape[0] / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("specs", nargs="*", type=Path, help="spec files (default: specs/*.yaml)")
    parser.add_argument("--batch", type=int, default=8, help="images a forward (default: %(default)s)")
    parser.add_argument("--max-weights-gb", type=float, default=2.0, help="largest model run (default: %(default)s)")
    args = parser.parse_args()
    torch.manual_seed(0)
    print("| spec | activated (stats) | dense (stats) | dense | CPU eager | GPU path | exported |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path in args.specs or sorted((ROOT / "specs").glob("*.yaml")):
        spec = moespec.load_spec(path)
        figures = stats(spec)
        if not spec.moe or figures.total_params * 4 > args.max_weights_gb * 1e9:
            continue
        x = torch.randn(args.batch, *spec.input_size)
        dense = counted(create_backbone(spec).eval(), x)
        model = moespec.create_model(spec).eval()
        eager, gpu = counted(model, x), counted(model, x, gpu_path=True)
        _, exported, _ = exported_gmacs(spec)
        print(f"| {path.stem} | {figures.gmacs:.2f} | {figures.dense_gmacs:.2f} | {dense:.2f} | {eager:.2f} | "
              f"{gpu:.2f} | {exported:.2f} |", flush=True)


if __name__ == "__main__":
    main()

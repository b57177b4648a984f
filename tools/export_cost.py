"""What an exported graph computes beside what the model activates: docs/training.md's export table.

    python tools/export_cost.py [SPEC ...]     # default: every spec in specs/; prints a markdown table

Under `torch.export` no shape may depend on the data, so a layer that routes sparsely runs every expert on
every item and combines them with the routing weights (`MoE._dense_combine`): E / k times its experts' compute
for top-k, E / (E·c/T) for expert choice, E / k per image for image routing; Soft MoE exports as it runs. Per
image at the spec's input size: the activated GMACs (`moespec stats`), the exported graph's (those, with each
layer's activated MACs replaced by its `exported_macs`, which tests/compiler/test_export_cost.py checks against
torch's FlopCounterMode on exported layers), their ratio, and the fp32 weights an exported program (or ONNX
file) carries: every parameter once, as the checkpoint does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import moespec  # noqa: E402
from moespec.counting import stats  # noqa: E402


def exported_gmacs(spec) -> tuple[float, float, int]:
    """(activated GMACs, exported GMACs, parameters) per image of `spec`."""
    counted = stats(spec)
    model = moespec.create_model(spec, device="meta")
    layers = moespec.moe_layers(model)
    exported = counted.gmacs
    for layer in counted.layers:
        exported += layers[layer.path].exported_macs(layer.items, 1) / 1e9 - layer.gmacs
    return counted.gmacs, exported, counted.total_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("specs", nargs="*", type=Path, help="spec files (default: specs/*.yaml)")
    args = parser.parse_args()
    paths = args.specs or sorted((ROOT / "specs").glob("*.yaml"))
    print("| spec | activated GMACs | exported GMACs | exported / activated | fp32 weights MB |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for path in paths:
        spec = moespec.load_spec(path)
        if not spec.moe:
            continue
        activated, exported, params = exported_gmacs(spec)
        ratio, megabytes = exported / activated, params * 4 / 1e6
        print(f"| {path.stem} | {activated:.2f} | {exported:.2f} | {ratio:.2f} | {megabytes:.0f} |", flush=True)


if __name__ == "__main__":
    main()

"""Peak memory and time of streaming upcycling (`moespec upcycle`), each case in a fresh process.

    python tools/measure_upcycle.py [--dtype fp32|bf16] [--only vit_b16|vit_h14] [--no-check] [--keep DIR]

Cases: ViT-B/16 with 8 experts on every 2nd block (specs/vit_b16_moe8_every2_top2.yaml, ~285M params), and
ViT-H/14 with 8 experts on every 2nd block (~2.1B params; written here, not shipped). Dense weights are a
fresh timm init saved to a temp file first, as a downloaded checkpoint would be. Peak RSS is the upcycling
process's own (ru_maxrss), measured after the dense checkpoint exists.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VIT_H14 = """\
name: vit_h14_moe8_every2_top2
backbone: {model: vit_huge_patch14_224}
moe:
  - where: {every: 2}
    experts: 8
    top_k: 2
    router: {normalize: true}
"""
CASES = {"vit_b16": "specs/vit_b16_moe8_every2_top2.yaml", "vit_h14": VIT_H14}


def one(spec_path: str, dense: str, out: str, dtype: str, check: str) -> None:
    """In a fresh process: upcycle, then print time, peak RSS and what was written as JSON."""
    import moespec
    from moespec.io import DTYPE_NAMES
    from moespec.weights import upcycle_to_checkpoint

    spec = moespec.load_spec(spec_path)
    start = time.perf_counter()
    files, report = upcycle_to_checkpoint(spec, out, checkpoint=dense, dtype=DTYPE_NAMES[dtype], check=check == "check")
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak_rss_gib": rss / 2**30, "files": len(files),
                      "bytes": sum(f.stat().st_size for f in files),
                      "check": str(report).splitlines()[0] if report else "not checked"}))


def save_dense(spec_path: str, dense: str) -> None:
    """In a fresh process: the dense backbone's fresh timm weights as safetensors."""
    from safetensors.torch import save_file

    import moespec
    from moespec.backbones import create_backbone

    model = create_backbone(moespec.load_spec(spec_path))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, dense)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--only", choices=list(CASES), action="append")
    parser.add_argument("--no-check", action="store_true", help="skip the function-preservation check")
    parser.add_argument("--keep", help="write outputs here instead of a temp folder")
    args = parser.parse_args()
    for name in args.only or list(CASES):
        with tempfile.TemporaryDirectory(dir=args.keep) as folder:
            spec = CASES[name]
            if not spec.endswith(".yaml"):
                spec = str(Path(folder) / f"{name}.yaml")
                Path(spec).write_text(CASES[name])
            dense, out = str(Path(folder) / "dense.safetensors"), str(Path(folder) / "model.safetensors")
            code = "import sys; sys.path.insert(0, 'tools'); import measure_upcycle as m; m.{}(*sys.argv[1:])"
            subprocess.run([sys.executable, "-c", code.format("save_dense"), spec, dense], check=True)
            dense_gib = Path(dense).stat().st_size / 2**30
            result = subprocess.run([sys.executable, "-c", code.format("one"), spec, dense, out, args.dtype,
                                     "no-check" if args.no_check else "check"],
                                    check=True, capture_output=True, text=True)
            figures = json.loads(result.stdout.strip().splitlines()[-1])
            print(f"{name} ({args.dtype}): {figures['seconds']:.1f} s, peak RSS {figures['peak_rss_gib']:.2f} GiB "
                  f"(dense checkpoint {dense_gib:.2f} GiB), wrote {figures['bytes'] / 2**30:.2f} GiB in "
                  f"{figures['files']} file(s); {figures['check']}", flush=True)


if __name__ == "__main__":
    main()

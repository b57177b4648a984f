"""Peak memory of a calibration pass (`moespec.compress.prune_with_report`) against the number of images, each
case in a fresh process.

    python tools/bench_calibration.py [--images 100 1200] [--size 224]

Each case writes N one-pixel PNGs to a temp folder (the transform resizes each to the input size, so every
image costs a full [3, size, size] tensor once read) and prunes a 2-block ViT of width 96 at that input size
(4 experts, top-2, in block 1) to 2 experts, scored and measured on the folder. Peak RSS is the process's own
(ru_maxrss) and includes torch and the model; the figure that matters is how it changes with N (times on a
shared machine are noise). Run it with PYTHONPATH set to another checkout to measure that one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASE = """
import json, resource, sys, time
import moespec
from moespec.compress import prune_with_report

size, folder = int(sys.argv[1]), sys.argv[2]
spec = moespec.load_spec({
    "name": "bench", "input_size": [3, size, size],
    "backbone": {"model": "vit_small_patch16_224", "kwargs": {"depth": 2, "img_size": size, "num_classes": 10,
                                                                  "embed_dim": 96, "num_heads": 3}},
    "moe": [{"where": {"blocks": [1]}, "experts": 4, "router": {"kind": "topk", "top_k": 2, "normalize": True}}]})
model = moespec.create_model(spec, seed=0).eval()
start = time.perf_counter()
_, report = prune_with_report(model, folder, keep=2)
print(json.dumps({"images": report.images, "seconds": time.perf_counter() - start, "moespec": moespec.__file__,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def one_pixel_pngs(folder: Path, count: int) -> None:
    from PIL import Image

    for i in range(count):
        Image.new("RGB", (1, 1), (i % 256, 0, 0)).save(folder / f"{i:05d}.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, nargs="+", default=[100, 1200], help="Image counts to measure.")
    parser.add_argument("--size", type=int, default=224, help="The model's input size (pixels).")
    args = parser.parse_args()
    rows = []
    for count in args.images:
        with tempfile.TemporaryDirectory() as folder:
            one_pixel_pngs(Path(folder), count)
            started = time.perf_counter()
            # cwd: the image folder, so that `python -c` imports moespec from PYTHONPATH or the install, not from
            # a checkout that happens to be the working directory
            done = subprocess.run([sys.executable, "-c", CASE, str(args.size), folder], capture_output=True,
                                  text=True, check=False, cwd=folder)
            if done.returncode:
                sys.exit(f"case of {count} images failed:\n{done.stderr}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row["process_seconds"] = time.perf_counter() - started
            rows.append(row)
            if len(rows) == 1:
                print(f"moespec: {row['moespec']}")
            print(f"{count:>6} images: peak RSS {row['peak_rss_mb']:.0f} MB, prune {row['seconds']:.1f} s",
                  flush=True)
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        per_image = (last["peak_rss_mb"] - first["peak_rss_mb"]) / (last["images"] - first["images"])
        print(f"growth: {per_image * 1024:.1f} KB per image between {first['images']} and {last['images']} images")


if __name__ == "__main__":
    main()

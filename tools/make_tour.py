"""Regenerate the README's Tour figures from the shipped specs (no network, no downloads; a few minutes on CPU).

    python tools/make_tour.py [--out docs]
    python tools/make_tour.py --images synthetic/    (only the synthetic images, for `moespec inspect`)

- docs/sweep.png: `moespec sweep specs/vit_s16_moe8_every2_top2.yaml --set moe.0.experts=4,8,16,32
  --set moe.0.router.top_k=1,2 --plot docs/sweep.png`
- docs/inspect_routing.png, docs/inspect_load.png: the first MoE layer (blocks.1.mlp) of
  `moespec inspect specs/vit_s16_moe8_every2_top2.yaml --images <synthetic folder> -o <report>`, where the
  folder is generated here: six classes of 8 images each, told apart only by low-level statistics
  (colour, stripes, checkerboard, smooth gradient). The model has a random init, so the figure shows what
  an untrained router does with such inputs, not learned specialization.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moespec.apps.inspect_report import write_report  # noqa: E402
from moespec.apps.inspection import find_images, inspect_routing, load_model  # noqa: E402
from moespec.apps.sweep import parse_setting, plot, sweep  # noqa: E402

SWEEP_SPEC = ROOT / "specs" / "vit_s16_moe8_every2_top2.yaml"
SWEEP_SETTINGS = ["moe.0.experts=4,8,16,32", "moe.0.router.top_k=1,2"]
INSPECT_SPEC = ROOT / "specs" / "vit_s16_moe8_every2_top2.yaml"
INSPECT_LAYER = 0  # the first MoE layer, blocks.1.mlp
IMAGES_PER_CLASS = 8


def synthetic_images(folder: Path, size: int = 96, seed: int = 0) -> Path:
    """Six classes of noisy synthetic images: red, green, blue, stripes, checkerboard, gradient."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size

    def base(name: str) -> np.ndarray:
        if name in ("red", "green", "blue"):
            colour = {"red": (200, 50, 40), "green": (50, 170, 60), "blue": (40, 70, 200)}[name]
            return np.broadcast_to(np.array(colour, float), (size, size, 3))
        phase = rng.uniform(0, 1)
        if name == "stripes":
            value = 0.5 + 0.5 * np.sin(2 * np.pi * (6 * x + phase))
        elif name == "checkerboard":
            value = ((np.floor(8 * x + phase) + np.floor(8 * y + phase)) % 2).astype(float)
        else:
            value = (x * rng.uniform(0.5, 1) + y * rng.uniform(0.5, 1)) / 2
        return np.repeat(255 * value[..., None], 3, axis=2)

    for name in ("red", "green", "blue", "stripes", "checkerboard", "gradient"):
        (folder / name).mkdir(parents=True)
        for i in range(IMAGES_PER_CLASS):
            pixels = np.clip(base(name) + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / name / f"{i}.png")
    return folder


def make_sweep(out: Path) -> None:
    points = sweep(SWEEP_SPEC, [parse_setting(s) for s in SWEEP_SETTINGS])
    assert all(p.stats is not None for p in points), [p.problems for p in points]
    target = out / "sweep.png"
    target.unlink(missing_ok=True)
    plot(points, target, title=f"{points[0].stats.name}: {len(points)} designs")
    for p in points:
        print(f"  {p.label}: {p.stats.total_params / 1e6:.1f}M params, {p.stats.gmacs:.3f} GMACs")


def make_inspect(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        images = synthetic_images(Path(tmp) / "images")
        source = str(INSPECT_SPEC.relative_to(ROOT))
        report = inspect_routing(load_model(INSPECT_SPEC), find_images(images), source=source)
        folder = write_report(report, Path(tmp) / "report")
        layer = report.layers[INSPECT_LAYER]
        for kind in ("routing", "load"):
            shutil.copyfile(folder / f"{INSPECT_LAYER:02d}_{layer.path}_{kind}.png", out / f"inspect_{kind}.png")
        for layer in report.layers:
            print(f"  {layer.path}: class order {[report.classes[c] for c in layer.class_order]}, "
                  f"load share {[round(x, 2) for x in layer.load_share]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--images", type=Path, help="only write the synthetic images into this new folder")
    args = parser.parse_args()
    if args.images is not None:
        if args.images.exists():
            parser.error(f"{args.images} already exists; name a new folder")
        print(f"wrote {len(list(synthetic_images(args.images).rglob('*.png')))} images into {args.images}")
        return
    args.out.mkdir(exist_ok=True)
    print("sweep:")
    make_sweep(args.out)
    print("inspect:")
    make_inspect(args.out)
    for name in ("sweep.png", "inspect_routing.png", "inspect_load.png"):
        print(f"wrote {args.out / name} ({(args.out / name).stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()

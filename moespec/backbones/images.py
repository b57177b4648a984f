"""Image files as timm's data pipeline reads them for a backbone: its eval transform (resize, center crop, the
pretrained_cfg's mean and std) at an input size, RGB or grayscale. `moespec inspect` routes them; upcycling
starts routers from them (`upcycle.router_init: hidden | kmeans`)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Iterable

import torch
from PIL import Image, UnidentifiedImageError
from timm.data import create_transform, resolve_data_config
from torch import nn

from ..errors import MoespecError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


def data_transform(model: nn.Module, input_size: tuple[int, int, int] | None, name: str, *,
                   use_test_size: bool = False):
    """timm's eval transform for `model` (its pretrained_cfg: resize, crop, mean, std) at `input_size`; returns
    (data config, transform). `name` (a spec file, a model) opens the error. With `input_size` None, timm picks
    the size from the pretrained_cfg: its `test_input_size` (and `test_crop_pct`) with `use_test_size`, as timm's
    validate.py does, else its `input_size`.

    Images are read as timm's data pipeline reads them: RGB for a 3-channel model, grayscale ("L") for a
    1-channel one (`in_chans: 1`), normalized by the mean of the pretrained_cfg's per-channel mean and std.
    Other channel counts have no image mode to read into and are refused."""
    args: dict[str, Any] = {} if input_size is None else {"input_size": tuple(input_size)}
    base = resolve_data_config(args, model=model, use_test_size=use_test_size)
    channels = base["input_size"][0]
    if channels == 1:
        args.update(mean=(sum(base["mean"]) / len(base["mean"]),), std=(sum(base["std"]) / len(base["std"]),))
    elif channels != 3:
        raise MoespecError(f"{name}: the model takes {channels}-channel images (input_size "
                           f"{list(base['input_size'])}); moespec reads image files as RGB (3 channels) or grayscale "
                           f"(1 channel), as timm's data pipeline does")
    config = resolve_data_config(args, model=model, use_test_size=use_test_size)
    return config, create_transform(**config)


def image_files(root: str | Path) -> list[Path]:
    """Every image file under the folder `root` (subfolders too), sorted by path: a fixed order, so that what is
    computed from them is reproducible."""
    root = Path(root)
    if not root.is_dir():
        raise MoespecError(f"{root}: no such folder of images" + (" (it is a file)" if root.exists() else ""))
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise MoespecError(f"{root}: no image files; image files end in {', '.join(IMAGE_SUFFIXES)}")
    return files


def read_image(path: Path, transform, channels: int, purpose: str = "moespec") -> torch.Tensor:
    """One image through `transform`, read as RGB (3 channels) or grayscale (1). An image over Pillow's
    decompression-bomb limit is never decoded (a `MoespecError`); an unreadable one raises what Pillow raises
    (`UNREADABLE`)."""
    try:
        with warnings.catch_warnings():  # over Pillow's MAX_IMAGE_PIXELS: a warning, twice over it an error
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                return transform(image.convert("RGB" if channels == 3 else "L"))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise MoespecError(f"{path}: {str(error).rstrip('.')}; refusing to decode it ({purpose} resizes every "
                           f"image to the model's input size: shrink this one or take it out of the folder)"
                           ) from None


UNREADABLE = (UnidentifiedImageError, OSError, ValueError)
"""What reading a file that is no image (or a damaged one) raises."""


def read_images(paths: Iterable[Path], transform, channels: int, skipped: list[str],
                purpose: str = "moespec") -> list[tuple[int, torch.Tensor]]:
    """(position in `paths`, tensor) of each readable image; each unreadable one is noted in `skipped`."""
    read = []
    for i, path in enumerate(paths):
        try:
            read.append((i, read_image(path, transform, channels, purpose)))
        except UNREADABLE as error:
            skipped.append(f"{path}: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
    return read

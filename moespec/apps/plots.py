"""Figures, drawn with matplotlib (the optional `plot` extra): presentation only; the numbers come from
`sweep.py` and `inspection.py`. matplotlib is imported inside the functions that draw: it is optional, and
importing it costs about a second that `moespec stats` should not pay.

matplotlib is used through `Figure` objects and the Agg canvas, never through pyplot, so drawing here
changes no global backend or state of the calling program.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import MoespecError
from ..io import atomic_output, check_output

if TYPE_CHECKING:  # matplotlib is optional: the annotations only name its type
    from matplotlib.figure import Figure

FORMATS = (".png", ".svg", ".pdf")
INSTALL_HINT = "pip install 'moespec[plot]'"


def require_matplotlib(what: str) -> None:
    """Fail with an install hint, before any work, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401  (lazy: optional, and about a second to import)
    except ImportError:
        raise MoespecError(f"{what} needs matplotlib, which is not installed; {INSTALL_HINT}") from None


def check_figure_path(path: Path, force: bool) -> None:
    """Fail before any work if a figure cannot be written to `path`."""
    if path.suffix.lower() not in FORMATS:
        raise MoespecError(f"{path}: unknown figure format {path.suffix!r}; use one of {', '.join(FORMATS)}")
    check_output(path, force)


def new_figure(width: float, height: float) -> "Figure":
    from matplotlib.figure import Figure  # lazy: optional, and about a second to import

    return Figure(figsize=(width, height), layout="constrained")


def save_figure(figure: "Figure", path: Path, dpi: int = 110, *, force: bool = True) -> Path:
    """Write `figure` through a temp file in the target folder and a rename, so a figure is whole or absent.
    Figures are checked with `check_figure_path` before any work, so this overwrites by default."""
    with atomic_output(path, force=force) as tmp:
        figure.savefig(tmp, format=path.suffix.lower()[1:], dpi=dpi)
    return path


def sweep_figure(title: str, points: Sequence[tuple[str, float, float]], front: Sequence[int],
                 dense: Sequence[tuple[str, float, float]]) -> "Figure":
    """Activated GMACs against total parameters (M): one labelled dot per `(label, params_m, gmacs)`, the
    Pareto front (indices into `points`) joined by a line, and the dense backbone(s) as stars."""
    from matplotlib.ticker import FuncFormatter  # lazy: optional, and about a second to import

    figure = new_figure(8.0, 5.2)
    axes = figure.add_subplot()
    others = [p for i, p in enumerate(points) if i not in set(front)]
    on_front = sorted((points[i] for i in front), key=lambda p: p[1])
    axes.scatter([p[1] for p in others], [p[2] for p in others], color="tab:blue", s=36, label="design", zorder=3)
    axes.plot([p[1] for p in on_front], [p[2] for p in on_front], "o-", color="tab:red", markersize=7,
              label="Pareto front (most parameters for the compute)", zorder=4)
    axes.scatter([d[1] for d in dense], [d[2] for d in dense], marker="*", s=220, color="black",
                 label="dense backbone", zorder=5)
    for i, (label, params, gmacs) in enumerate(sorted([*points, *dense], key=lambda p: p[1])):
        below = i % 2 == 1  # alternate above / below, so that neighbours at similar cost do not collide
        axes.annotate(label, (params, gmacs), textcoords="offset points", xytext=(5, -12 if below else 5), fontsize=8)
    axes.set_xscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    axes.xaxis.set_major_formatter(plain)
    axes.xaxis.set_minor_formatter(plain)
    axes.tick_params(axis="x", which="minor", labelsize=7)
    axes.set_xlabel("total parameters (M, log scale)")
    axes.set_ylabel("activated GMACs per image")
    axes.set_title(title, fontsize=11)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="best", fontsize=8)
    axes.margins(x=0.2, y=0.12)
    return figure


def routing_heatmap(title: str, classes: Sequence[str], share: Sequence[Sequence[float]], label: str) -> "Figure":
    """Classes (rows, in the given order) x experts (columns); a cell is `share[row][expert]`, with a
    colorbar. Cells carry their value while the grid is small enough to read them."""
    values = np.asarray(share, dtype=float)
    rows, experts = values.shape
    figure = new_figure(min(14.0, 3.6 + 0.42 * experts + 0.06 * max(map(len, classes))),
                        min(16.0, max(3.2, 1.8 + 0.3 * rows)))
    axes = figure.add_subplot()
    image = axes.imshow(values, aspect="auto", cmap="viridis", vmin=0.0, vmax=max(float(values.max()), 1e-9),
                        interpolation="nearest")
    figure.colorbar(image, ax=axes, label=label, fraction=0.08, pad=0.02)
    step = max(1, experts // 32)
    axes.set_xticks(range(0, experts, step))
    axes.set_xlabel("expert")
    if rows <= 80:
        axes.set_yticks(range(rows), [str(c) for c in classes], fontsize=8 if rows > 20 else 9)
    else:
        axes.set_yticks([])
    axes.set_ylabel("class (grouped by top expert)")
    if rows * experts <= 160:
        middle = values.max() / 2
        for (r, e), value in np.ndenumerate(values):
            axes.text(e, r, f"{value:.2f}", ha="center", va="center", fontsize=7,
                      color="black" if value > middle else "white")
    axes.set_title(title, fontsize=10)
    return figure


def load_figure(title: str, load_share: Sequence[float]) -> "Figure":
    """The share of all routed assignments each expert took, against the uniform share 1 / E."""
    experts = len(load_share)
    figure = new_figure(min(12.0, 3.5 + 0.3 * experts), 3.4)
    axes = figure.add_subplot()
    axes.bar(range(experts), load_share, color="tab:blue", width=0.8)
    axes.axhline(1 / experts, color="tab:red", linestyle="--", linewidth=1, label=f"uniform (1/{experts})")
    step = max(1, experts // 32)
    axes.set_xticks(range(0, experts, step))
    axes.set_xlabel("expert")
    axes.set_ylabel("share of assignments")
    axes.set_ylim(0, max(max(load_share), 1 / experts) * 1.25)
    axes.legend(fontsize=8, loc="upper right")
    axes.set_title(title, fontsize=10)
    return figure

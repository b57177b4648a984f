"""The `moespec inspect` report folder: summary.json, a routing heatmap and a load chart per MoE layer, and an
index.html that shows them. Written whole or not at all (`io.atomic_output`)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any, Sequence

from ..errors import MoespecError
from ..io import atomic_output
from .inspection import LayerRouting, RoutingReport
from .plots import load_figure, routing_heatmap, save_figure


def write_report(report: RoutingReport, output: str | Path, *, force: bool = False,
                 inputs: Sequence[str | Path | None] = ()) -> Path:
    """Write the report folder: it is built next to `output` and renamed into place once complete, so
    `output` is always either the previous report or the whole new one. `output` may not hold any of the
    `inputs` (the image folder, the checkpoint): replacing it would delete them."""
    check_report_folder(output, inputs)
    with atomic_output(output, force=force, folder=True) as building:
        _write_files(report, building)
    return Path(output)


def check_report_folder(output: str | Path, inputs: Sequence[str | Path | None]) -> None:
    """Refuse a report folder that is one of `inputs`, holds one or lies inside one (`--force` replaces the
    folder whole, and a report inside the image folder would become part of the data)."""
    folder = Path(output).resolve()
    for given in inputs:
        if given is None:
            continue
        path = Path(given).resolve()
        if path == folder or folder in path.parents or path in folder.parents:
            raise MoespecError(f"{output}: the report folder would replace or sit inside {given}, which it holds or "
                               f"lies in; write the report to a folder of its own, outside the images and the "
                               f"checkpoint")


def figure_names(index: int, layer: LayerRouting) -> dict[str, str]:
    stem = f"{index:02d}_{layer.path}"
    return {"heatmap": f"{stem}_routing.png", "load": f"{stem}_load.png"}


def _write_files(report: RoutingReport, folder: Path) -> None:
    summary = report.to_dict()
    for index, (layer, record) in enumerate(zip(report.layers, summary["layers"], strict=True)):
        names = figure_names(index, layer)
        record["figures"] = names
        rows = [report.classes[c] for c in layer.class_order]
        share = [layer.share[c] for c in layer.class_order]
        save_figure(routing_heatmap(_heatmap_title(layer), rows, share, layer.share_label), folder / names["heatmap"])
        save_figure(load_figure(_load_title(layer), layer.load_share), folder / names["load"])
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (folder / "index.html").write_text(_html(report, summary), encoding="utf-8")


def _heatmap_title(layer: LayerRouting) -> str:
    return f"{layer.path}: routing by class ({layer.router_name}, {layer.experts} experts)"


def _load_title(layer: LayerRouting) -> str:
    return f"{layer.path}: expert load, {layer.drop_fraction:.1%} of {layer.unit}s dropped"


def _html(report: RoutingReport, summary: dict[str, Any]) -> str:
    """A static page that shows every figure, with the numbers that frame them."""
    e = html.escape
    counts = ", ".join(f"{e(name)} ({n})" for name, n in zip(report.classes, report.images_per_class, strict=True))
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>moespec inspect: {e(report.model)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1400px} img{max-width:100%;border:1px solid #ddd}"
        " .row{display:flex;gap:1em;flex-wrap:wrap;align-items:flex-start} td,th{padding:2px 8px;text-align:left}"
        "</style></head><body>",
        f"<h1>What the experts do: {e(report.model)}</h1>",
        "<table>",
        f"<tr><th>model</th><td>{e(report.source)}</td></tr>",
        f"<tr><th>input</th><td>{e(str(list(report.input_size)))}, timm data config "
        f"{e(json.dumps(report.data_config))}</td></tr>",
        f"<tr><th>images</th><td>{sum(report.images_per_class)} in {len(report.classes)} classes: {counts}</td></tr>",
    ]
    parts.append(f"<tr><th>per image</th><td>{report.experts_per_image:.1f} experts (distinct, summed over the "
                 f"layers), {report.activated_params_per_image / 1e6:.2f}M parameters</td></tr>")
    if report.skipped:
        parts.append(f"<tr><th>skipped</th><td>{len(report.skipped)} unreadable file(s)</td></tr>")
    parts += ["</table>",
              "<p>Each heatmap row is a class, each column an expert; a cell is the share of the class's tokens "
              "(images, for image-level routing) that the layer sends to the expert, so a row sums to k, less the "
              "tokens dropped (expert choice: c on average; Soft MoE: the combine weight mass, a row sums to 1). "
              "Rows are grouped by the expert that takes most of the class. The numbers are in "
              "<a href='summary.json'>summary.json</a>.</p>"]
    for layer, record in zip(report.layers, summary["layers"], strict=True):
        figures = record["figures"]
        parts += [f"<h2>{e(layer.path)}</h2>",
                  f"<p>{e(layer.router_name)}, {layer.experts} experts, {layer.items} {e(layer.unit)}s routed, "
                  f"{layer.drop_fraction:.2%} dropped, {layer.experts_per_image:.2f} distinct experts per image</p>",
                  "<div class='row'>",
                  f"<img src='{e(figures['heatmap'])}' alt='routing heatmap of {e(layer.path)}'>",
                  f"<img src='{e(figures['load'])}' alt='expert load of {e(layer.path)}'>",
                  "</div>"]
    parts.append("</body></html>\n")
    return "\n".join(parts)

"""Rendering stats records as a table, Markdown, CSV or JSON, and a plan as a table. Data comes from `stats.py`
and `planning`; nothing here counts."""

from __future__ import annotations

import csv
import io
import json
from typing import Any, Sequence

import yaml
from rich.console import Console
from rich.table import Table

from ..planning import Plan
from .stats import SpecStats

FORMATS = ("table", "markdown", "csv", "json")

SPEC_COLUMNS = ("name", "backbone", "MoE layers", "experts (all layers)", "params (M)", "activated (M)", "GMACs",
                "dense params (M)", "dense GMACs")
LAYER_COLUMNS = ("name", "module", "experts", "k", "shared", "items", "params (M)", "activated (M)", "GMACs",
                 "executed GMACs")
FOOTER = ("experts (all layers): routed experts summed over the MoE layers. params: total parameters. "
          "activated: parameters used per routed item (everything outside MoE layers "
          "+ routers + shared experts + top_k routed experts). GMACs: 10^9 multiply-adds per image at batch 1 "
          "(fvcore's convention: one MAC = one flop), MoE layers at k experts per item with perfect balance and "
          "no drops. M = 10^6; exact counts in --format json.")


def spec_rows(records: Sequence[SpecStats]) -> list[tuple[str, ...]]:
    return [(s.name, s.backbone, str(s.moe_layers), str(s.experts_total), _m(s.total_params), _m(s.activated_params),
             f"{s.gmacs:.3f}", _m(s.dense_params), f"{s.dense_gmacs:.3f}") for s in records]


def layer_rows(records: Sequence[SpecStats]) -> list[tuple[str, ...]]:
    """One row per MoE layer, then one for the dense remainder of each spec (everything else)."""
    rows = []
    for s in records:
        for layer in s.layers:
            executed = f"{layer.executed_gmacs:.3f}" if layer.executed_gmacs is not None else "-"
            rows.append((s.name, layer.path, str(layer.experts), str(layer.top_k), str(layer.shared_experts),
                         str(layer.items), _m(layer.params), _m(layer.activated_params), f"{layer.gmacs:.3f}",
                         executed))
        rest_params = s.total_params - sum(layer.params for layer in s.layers)
        rest_gmacs = s.gmacs - sum(layer.gmacs for layer in s.layers)
        rows.append((s.name, "(dense remainder)", "-", "-", "-", "-", _m(rest_params), _m(rest_params),
                     f"{rest_gmacs:.3f}", "-"))
    return rows


def render(records: Sequence[SpecStats], format: str, per_layer: bool = False,
           settings: Sequence[dict[str, Any]] | None = None) -> str:
    """The records in `format` (one of FORMATS) as text. `settings` (one mapping per record, the same keys
    in each, e.g. the swept values of `moespec sweep`) adds a column per key after the name, and a
    "settings" entry to each JSON record."""
    if format == "json":
        dicts = [s.to_dict() for s in records]
        if settings is not None:
            dicts = [{"name": d["name"], "settings": values, **d} for d, values in zip(dicts, settings, strict=True)]
        return json.dumps(dicts, indent=2) + "\n"
    columns, rows = (LAYER_COLUMNS, layer_rows(records)) if per_layer else (SPEC_COLUMNS, spec_rows(records))
    keys: list[str] = list(settings[0]) if settings else []
    if keys:
        per_record = [layer_rows([s]) if per_layer else spec_rows([s]) for s in records]
        rows = [(row[0], *(show(values[k]) for k in keys), *row[1:])
                for record_rows, values in zip(per_record, settings, strict=True) for row in record_rows]
        columns = (columns[0], *keys, *columns[1:])
    if format == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)
        return buffer.getvalue()
    if format == "markdown":
        lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines) + f"\n\n{FOOTER}\n"
    table = Table(caption=FOOTER, caption_justify="left")
    for i, column in enumerate(columns):
        text = i < 2 + len(keys)  # the name, the settings and the backbone
        table.add_column(column, justify="left" if text else "right", no_wrap=text)
    for row in rows:
        table.add_row(*row)
    console = Console(width=max(100, sum(len(c) + 3 for c in columns) + 40), record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


def show(value: Any) -> str:
    """A value as YAML flow text: `8`, `true`, `{every: 2}`, `[{last: 1}]`."""
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip()
    return text.removesuffix("...").strip()


def _m(count: int) -> str:
    return f"{count / 1e6:.2f}"


def plan_table(plan: Plan) -> Table:
    """`moespec plan`'s table: one row per MoE layer, numbers right-aligned."""
    table = Table()
    for i, column in enumerate(plan.COLUMNS):
        table.add_column(column, justify="right" if 2 <= i <= 7 else "left")
    for row in plan.rows():
        table.add_row(*row)
    return table

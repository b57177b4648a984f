"""Rendering stats records (with their per-rank figures, if asked) as a table, Markdown, CSV or JSON, and a plan
as a table. Data comes from `stats.py`, `ranks.py` and `planning`; nothing here counts."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict
from typing import Any, Sequence

import yaml
from rich.console import Console
from rich.table import Table

from ..planning.table import plan_table  # noqa: F401 (`counting.plan_table`, as before)
from .ranks import TRAIN_BYTES_PER_PARAM, RankStats
from .stats import SpecStats

SPEC_COLUMNS = ("name", "backbone", "MoE layers", "experts (all layers)", "params (M)", "activated (M)", "GMACs",
                "dense params (M)", "dense GMACs")
LAYER_COLUMNS = ("name", "module", "experts", "k", "shared", "items", "params (M)", "activated (M)", "GMACs",
                 "executed GMACs")
FOOTER = ("experts (all layers): routed experts summed over the MoE layers. params: total parameters. "
          "activated: parameters used per routed item (everything outside MoE layers "
          "+ routers + shared experts + the routed experts an item uses: top_k, E*C/T for expert choice, all for "
          "Soft MoE). GMACs: 10^9 multiply-adds per image at batch 1 (fvcore's convention: one MAC = one flop), "
          "MoE layers at those experts per item with perfect balance and no drops. M = 10^6; exact counts in "
          "--format json.")
EVAL_COLUMNS = ("eval activated (M)", "eval GMACs")
EVAL_LAYER_COLUMNS = ("eval k", "eval activated (M)", "eval GMACs")
EVAL_FOOTER = ("eval: the same figures in eval mode, where a router's eval_top_k or eval_capacity_factor makes them "
               "differ from training's (- where they do not).")
RANK_COLUMNS = ("ranks", "params/rank (M)", "experts/rank (M)", "replicated (M)", "fp32 train GB/rank")
RANK_FOOTER = ("ranks: expert parallelism, each MoE layer's routed experts split evenly over the ranks, everything "
               "else (backbone, routers, shared experts) replicated on every rank. params/rank = experts/rank + "
               f"replicated. fp32 train GB/rank: {TRAIN_BYTES_PER_PARAM} bytes per parameter on a rank (fp32 weight, "
               "gradient and AdamW's two moments), GB = 10^9 bytes; activations not included.")


def has_eval(records: Sequence[SpecStats]) -> bool:
    """Whether any record's eval-mode figures differ from its training ones (the eval columns are shown)."""
    return any(s.eval_gmacs is not None for s in records)


def spec_rows(records: Sequence[SpecStats], evals: bool = False) -> list[tuple[str, ...]]:
    """One row per spec; with `evals`, the eval-mode activated params and GMACs at the end."""
    return [(s.name, s.backbone, str(s.moe_layers), str(s.experts_total), _m(s.total_params), _m(s.activated_params),
             f"{s.gmacs:.3f}", _m(s.dense_params), f"{s.dense_gmacs:.3f}",
             *((_m_or_dash(s.eval_activated_params), _g_or_dash(s.eval_gmacs)) if evals else ())) for s in records]


def layer_rows(records: Sequence[SpecStats], evals: bool = False) -> list[tuple[str, ...]]:
    """One row per MoE layer, then one for the dense remainder of each spec (everything else); with `evals`, the
    eval-mode k, activated params and GMACs at the end."""
    rows = []
    for s in records:
        for layer in s.layers:
            executed = f"{layer.executed_gmacs:.3f}" if layer.executed_gmacs is not None else "-"
            extra = (str(layer.eval_top_k or "-"), _m_or_dash(layer.eval_activated_params),
                     _g_or_dash(layer.eval_gmacs)) if evals else ()
            rows.append((s.name, layer.path, str(layer.experts), str(layer.top_k), str(layer.shared_experts),
                         str(layer.items), _m(layer.params), _m(layer.activated_params), f"{layer.gmacs:.3f}",
                         executed, *extra))
        rest_params = s.total_params - sum(layer.params for layer in s.layers)
        rest_gmacs = s.gmacs - sum(layer.gmacs for layer in s.layers)
        rows.append((s.name, "(dense remainder)", "-", "-", "-", "-", _m(rest_params), _m(rest_params),
                     f"{rest_gmacs:.3f}", "-", *(("-",) * len(EVAL_LAYER_COLUMNS) if evals else ())))
    return rows


def rank_cells(r: RankStats) -> tuple[str, ...]:
    """The per-rank columns of one spec's row, in the order of RANK_COLUMNS."""
    return (str(r.ranks), _m(r.params_per_rank), _m(r.expert_params_per_rank), _m(r.replicated_params),
            f"{r.train_bytes_per_rank / 1e9:.2f}")


def rank_summary(r: RankStats) -> str:
    """`moespec plan --ranks`'s lines: one rank's parameters and fp32 training memory."""
    return (f"per rank, expert parallelism over {r.ranks} ranks: {r.params_per_rank:,} params = "
            f"{r.expert_params_per_rank:,} in experts (1/{r.ranks} of each MoE layer's) + "
            f"{r.replicated_params:,} replicated (backbone, routers, shared experts)\n"
            f"fp32 training memory per rank: {r.train_bytes_per_rank / 1e9:.2f} GB ({TRAIN_BYTES_PER_PARAM} bytes "
            f"per parameter: weight, gradient, AdamW's two moments; activations not included)")


def render(records: Sequence[SpecStats], format: str, per_layer: bool = False,
           settings: Sequence[dict[str, Any]] | None = None, ranks: Sequence[RankStats] | None = None) -> str:
    """The records in `format` (one of `choices.STATS_FORMATS`) as text. `settings` (one mapping per record, the
    same keys in each, e.g. the swept values of `moespec sweep`) adds a column per key after the name, and a
    "settings" entry to each JSON record. `ranks` (one `RankStats` per record; not with `per_layer`) adds the
    per-rank columns at the end, and a "per_rank" entry to each JSON record."""
    if ranks is not None and per_layer:
        raise ValueError("per-rank figures are per spec; they do not combine with per_layer")
    if format == "json":
        dicts = [s.to_dict() for s in records]
        if settings is not None:
            dicts = [{"name": d["name"], "settings": values, **d} for d, values in zip(dicts, settings, strict=True)]
        if ranks is not None:
            dicts = [{**d, "per_rank": asdict(r)} for d, r in zip(dicts, ranks, strict=True)]
        return json.dumps(dicts, indent=2) + "\n"
    evals = has_eval(records)
    columns, rows = (LAYER_COLUMNS, layer_rows(records, evals)) if per_layer else (SPEC_COLUMNS,
                                                                                    spec_rows(records, evals))
    if evals:
        columns = (*columns, *(EVAL_LAYER_COLUMNS if per_layer else EVAL_COLUMNS))
    keys: list[str] = list(settings[0]) if settings else []
    if keys:
        per_record = [layer_rows([s], evals) if per_layer else spec_rows([s], evals) for s in records]
        rows = [(row[0], *(show(values[k]) for k in keys), *row[1:])
                for record_rows, values in zip(per_record, settings, strict=True) for row in record_rows]
        columns = (columns[0], *keys, *columns[1:])
    footer = f"{FOOTER} {EVAL_FOOTER}" if evals else FOOTER
    if ranks is not None:
        rows = [(*row, *rank_cells(r)) for row, r in zip(rows, ranks, strict=True)]
        columns, footer = (*columns, *RANK_COLUMNS), f"{footer} {RANK_FOOTER}"
    return tabulate(columns, rows, format, footer, text_columns=2 + len(keys))


def tabulate(columns: Sequence[str], rows: Sequence[Sequence[str]], format: str, footer: str = "",
             text_columns: int = 1) -> str:
    """Rows of cells as CSV, Markdown (with `footer` below) or a text table (`footer` as its caption; the first
    `text_columns` columns left-aligned and never wrapped, the others right-aligned)."""
    if format == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)
        return buffer.getvalue()
    if format == "markdown":
        lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines) + (f"\n\n{footer}\n" if footer else "\n")
    table = Table(caption=footer or None, caption_justify="left")
    for i, column in enumerate(columns):
        text = i < text_columns
        table.add_column(column, justify="left" if text else "right", no_wrap=text)
    for row in rows:
        table.add_row(*row)
    console = Console(width=max(100, sum(len(c) + 3 for c in columns) + 40), record=True, file=io.StringIO(),
                      highlight=False)
    console.print(table)
    return console.export_text()


def show(value: Any) -> str:
    """A value as YAML flow text: `8`, `true`, `{every: 2}`, `[{last: 1}]`."""
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip()
    return text.removesuffix("...").strip()


def _m(count: int) -> str:
    return f"{count / 1e6:.2f}"


def _m_or_dash(count: int | None) -> str:
    return "-" if count is None else _m(count)


def _g_or_dash(gmacs: float | None) -> str:
    return "-" if gmacs is None else f"{gmacs:.3f}"

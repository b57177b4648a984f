"""Rendering stats records and plans (moespec.counting.report), on hand-made records: no model is built."""

from __future__ import annotations

import csv
import io
import json

from rich.console import Console

import moespec
from moespec.counting import LayerStats, SpecStats, per_rank, plan_table, render

from ..conftest import TINY_VIT, make_spec

# A made-up spec: 30.5M params in all, two MoE layers of 8 experts of 1.25M params each plus a 0.0625M router.
LAYER = LayerStats(path="blocks.1.mlp", experts=8, top_k=2, shared_experts=0, params=10_062_500,
                   routed_params=10_000_000, activated_params=2_562_500, gmacs=0.5, items=197)
CAPPED = LayerStats(path="blocks.3.mlp", experts=8, top_k=2, shared_experts=1, params=11_312_500,
                    routed_params=10_000_000, activated_params=3_812_500, gmacs=0.75, items=197, executed_gmacs=0.9375)
RECORD = SpecStats(name="made-up", spec="", backbone="vit_small_patch16_224", input_size=(3, 224, 224),
                   total_params=30_500_000, activated_params=15_437_500, dense_params=22_050_000, gmacs=4.61234,
                   dense_gmacs=4.6, moe_layers=2, experts_total=16, layers=[LAYER, CAPPED])


def test_csv_has_one_row_per_spec_with_millions_and_three_decimals():
    rows = list(csv.reader(io.StringIO(render([RECORD], "csv"))))
    assert rows[0] == ["name", "backbone", "MoE layers", "experts (all layers)", "params (M)", "activated (M)", "GMACs",
                       "dense params (M)", "dense GMACs"]
    # 30_500_000 / 1e6 = 30.50; 15_437_500 / 1e6 = 15.4375 -> 15.44; 4.61234 -> 4.612
    assert rows[1] == ["made-up", "vit_small_patch16_224", "2", "16", "30.50", "15.44", "4.612", "22.05", "4.600"]


def test_per_layer_rows_end_with_the_dense_remainder():
    rows = list(csv.reader(io.StringIO(render([RECORD], "csv", per_layer=True))))
    assert rows[1] == ["made-up", "blocks.1.mlp", "8", "2", "0", "197", "10.06", "2.56", "0.500", "-"]
    assert rows[2] == ["made-up", "blocks.3.mlp", "8", "2", "1", "197", "11.31", "3.81", "0.750", "0.938"]
    # remainder: 30.5M - 10.0625M - 11.3125M = 9.125M params; 4.61234 - 0.5 - 0.75 = 3.36234 GMACs
    assert rows[3] == ["made-up", "(dense remainder)", "-", "-", "-", "-", "9.12", "9.12", "3.362", "-"]


def test_json_keeps_exact_counts_and_round_trips():
    (record,) = json.loads(render([RECORD], "json"))
    assert record["total_params"] == 30_500_000 and record["input_size"] == [3, 224, 224]
    assert record["layers"][1]["executed_gmacs"] == 0.9375
    assert SpecStats(**{**record, "input_size": tuple(record["input_size"]),
                        "layers": [LayerStats(**layer) for layer in record["layers"]]}) == RECORD


def test_markdown_is_a_table_with_the_counting_convention_under_it():
    lines = render([RECORD], "markdown").splitlines()
    assert lines[0].startswith("| name | backbone | MoE layers |") and lines[1].startswith("|---|---|")
    assert lines[2] == "| made-up | vit_small_patch16_224 | 2 | 16 | 30.50 | 15.44 | 4.612 | 22.05 | 4.600 |"
    assert "fvcore's convention: one MAC = one flop" in lines[-1]


def test_the_terminal_table_shows_every_column_and_value():
    text = render([RECORD], "table")
    for value in ("made-up", "vit_small_patch16_224", "30.50", "15.44", "4.612", "activated (M)"):
        assert value in text


def test_sweep_settings_become_columns_after_the_name():
    rows = list(csv.reader(io.StringIO(render([RECORD], "csv", settings=[{"moe.0.experts": 8, "moe.0.where":
                                                                          {"every": 2}}]))))
    assert rows[0][:4] == ["name", "moe.0.experts", "moe.0.where", "backbone"]
    assert rows[1][:4] == ["made-up", "8", "{every: 2}", "vit_small_patch16_224"]
    (record,) = json.loads(render([RECORD], "json", settings=[{"moe.0.experts": 8}]))
    assert list(record)[:2] == ["name", "settings"] and record["settings"] == {"moe.0.experts": 8}


def test_per_rank_figures_become_the_last_columns_and_a_json_entry():
    split = per_rank(RECORD, 4)  # 20M routed -> 5M per rank; 30.5M - 20M = 10.5M replicated; 16 B x 15.5M
    rows = list(csv.reader(io.StringIO(render([RECORD], "csv", ranks=[split], settings=[{"moe.0.experts": 8}]))))
    assert rows[0][:2] == ["name", "moe.0.experts"]
    assert rows[0][-5:] == ["ranks", "params/rank (M)", "experts/rank (M)", "replicated (M)", "fp32 train GB/rank"]
    assert rows[1][-5:] == ["4", "15.50", "5.00", "10.50", "0.25"]
    (record,) = json.loads(render([RECORD], "json", ranks=[split]))
    assert record["per_rank"] == {"ranks": 4, "expert_params_per_rank": 5_000_000, "replicated_params": 10_500_000,
                                  "params_per_rank": 15_500_000, "train_bytes_per_rank": 248_000_000}
    assert render([RECORD], "markdown", ranks=[split]).splitlines()[-1].endswith(
        "GB = 10^9 bytes; activations not included.")
    assert "fp32 train GB/rank" in render([RECORD], "table", ranks=[split])


def test_plan_table_has_the_plan_columns_and_rows():
    plan = moespec.plan(make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4, "top_k": 2}]))
    table = plan_table(plan)
    assert [column.header for column in table.columns] == list(plan.COLUMNS)
    assert table.row_count == 2
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(table)
    text = console.export_text()
    assert "blocks.0.mlp" in text and "blocks.1.mlp" in text and "topk/linear" in text

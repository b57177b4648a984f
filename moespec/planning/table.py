"""`moespec plan`'s table, rendered with rich and free of torch: a plan from a warm cache prints without
importing torch, timm or fvcore (they took 13 s and 850 MB for `plan` with a warm cache)."""

from __future__ import annotations

from rich.table import Table

from .plan import Plan


def plan_table(plan: Plan) -> Table:
    """`moespec plan`'s table: one row per MoE layer, numbers right-aligned."""
    table = Table()
    for i, column in enumerate(plan.COLUMNS):
        table.add_column(column, justify="right" if 2 <= i <= 7 else "left")
    for row in plan.rows():
        table.add_row(*row)
    return table

"""Stage 7, counting: parameters and MACs of a spec, and their presentation.

    flops.py   fvcore with moespec's op handles; MoE layers costed analytically
    stats.py   SpecStats / LayerStats records: total and activated params and GMACs, dense for comparison
    report.py  records (and plans) as a table, Markdown, CSV or JSON
"""

from .flops import FLOP_HANDLES, MacCount, count_macs, register_flop_handle
from .report import FORMATS, plan_table, render
from .stats import LayerStats, SpecStats, count_params, stats

__all__ = ["FLOP_HANDLES", "FORMATS", "LayerStats", "MacCount", "SpecStats", "count_macs", "count_params", "plan_table",
           "register_flop_handle", "render", "stats"]

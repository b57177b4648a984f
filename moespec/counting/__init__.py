"""Stage 7, counting: parameters and MACs of a spec, and their presentation.

    flops.py   fvcore with moespec's op handles; MoE layers costed analytically
    budget.py  refuse a count whose forward would take more MACs or memory than the machine can give
    stats.py   SpecStats / LayerStats records: total and activated params and GMACs, dense for comparison
    ranks.py   RankStats: one rank's params and fp32 training bytes under expert parallelism over W ranks
    report.py  records (and plans) as a table, Markdown, CSV or JSON
"""

from ..choices import STATS_FORMATS as FORMATS  # the renderers of `report.render`
from .flops import FLOP_HANDLES, MacCount, count_macs, fvcore_handles, register_flop_handle
from .ranks import RankStats, per_rank
from .report import plan_table, rank_summary, render, tabulate
from .stats import LayerStats, SpecStats, at_input_size, count_params, stats

__all__ = ["FLOP_HANDLES", "FORMATS", "LayerStats", "MacCount", "RankStats", "SpecStats", "at_input_size", "count_macs",
           "count_params", "fvcore_handles", "per_rank", "plan_table", "rank_summary", "register_flop_handle", "render",
           "stats", "tabulate"]

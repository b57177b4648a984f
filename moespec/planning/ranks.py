"""Whether a model's experts split evenly over W ranks of expert parallelism (`stats --ranks`, `shard_experts`,
`moespec.distributed.load`)."""

from __future__ import annotations

import math


def uneven_experts(experts: dict[str, int], ranks: int) -> str | None:
    """None if every MoE layer's experts (`experts`: layer path -> E) split evenly over `ranks` ranks; else one
    line naming the layers that do not, grouped by E, and the rank counts that would work (the divisors of the
    gcd of the layers' experts)."""
    uneven = {path: count for path, count in experts.items() if count % ranks}
    if not uneven:
        return None
    groups = []
    for count in sorted(set(uneven.values())):
        paths = [path for path, e in uneven.items() if e == count]
        shown = paths if len(paths) <= 3 else [*paths[:3], f"{len(paths) - 3} more"]
        names = f"{', '.join(shown[:-1])} and {shown[-1]}" if len(shown) > 1 else shown[0]
        groups.append(f"{names} {'has' if len(paths) == 1 else 'have'} {count} experts")
    common = math.gcd(*experts.values())
    allowed = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
    return (f"{ranks} ranks do not split the experts evenly: {'; '.join(groups)}; the number of ranks must divide "
            f"every MoE layer's experts: {allowed}")

"""Time building and tracing (create_model on CPU) of every shipped spec that fits in memory.

Each spec runs in a fresh process, so one giant spec's freed memory does not slow the next one down.

    python tools/time_compile.py [specs/]
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def one(path: str) -> None:
    import moespec
    from moespec.errors import MoespecError

    spec = moespec.load_spec(path)
    start = time.perf_counter()
    try:
        model = moespec.create_model(spec)
    except MoespecError as error:  # too large to instantiate here
        print(f"skipped ({str(error).split(';')[0]})")
        return
    params = sum(p.numel() for p in model.parameters())
    print(f"{time.perf_counter() - start:.2f} s  ({params / 1e6:,.0f}M params)")


def main(folder: str = "specs") -> None:
    print(f"{'spec':36s} build + trace")
    for path in sorted(Path(folder).glob("*.yaml")):
        run = subprocess.run([sys.executable, __file__, "--one", str(path)], capture_output=True, text=True)
        print(f"{path.stem:36s} {(run.stdout.strip() or run.stderr.strip().splitlines()[-1])}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        one(sys.argv[2])
    else:
        main(*sys.argv[1:])

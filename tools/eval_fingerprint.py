"""A fingerprint of every shipped spec's seeded eval output, to hold a refactor to "nothing else changes":

    python tools/eval_fingerprint.py [SPEC ...] [--limit PARAMS]      # one line per spec: name, params, sha256

Each spec's model is built with `create_model(spec, seed=0)` in eval mode and run on one seeded image at the
spec's input size, without autograd; the line carries the sha256 of the output's bytes, so two runs (before and
after a change, from two checkouts) are bit-equal exactly when their lines are. Specs over `--limit` parameters
(default 3e9, the size `tests/test_specs.py` marks too large to instantiate here) are listed without a hash.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import moespec  # noqa: E402

SPECS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specs")


def fingerprint(path: str, limit: int) -> str:
    """`name params sha256` of the spec at `path` (or `name params too-large`)."""
    spec = moespec.load_spec(path)
    plan = moespec.plan(spec)
    params = sum(p.numel() for p in moespec.create_model(spec, device="meta").parameters())
    name = os.path.basename(path).removesuffix(".yaml")
    if params > limit:
        return f"{name} {params} too-large"
    model = moespec.create_model(spec, seed=0).eval()
    generator = torch.Generator().manual_seed(0)
    image = torch.randn(1, *plan.input_size, generator=generator)
    with torch.no_grad():
        out = model(image)
    return f"{name} {params} {hashlib.sha256(out.contiguous().numpy().tobytes()).hexdigest()[:16]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="*", help="spec files (default: every spec in specs/)")
    parser.add_argument("--limit", type=float, default=3e9, help="parameters above which a spec is not built")
    args = parser.parse_args()
    paths = args.specs or sorted(os.path.join(SPECS, f) for f in os.listdir(SPECS) if f.endswith(".yaml"))
    for path in paths:
        start = time.perf_counter()
        line = fingerprint(path, int(args.limit))
        print(f"{line}  ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

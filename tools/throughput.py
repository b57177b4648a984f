"""The seeds' throughput column beside what `moespec bench` measures here: the "Throughput" section of
docs/reproduction.md (tools/reproduction.py renders it from this module and tools/throughput.json).

    python tools/throughput.py --measure [--only SPEC]   # bench every measurable pair, into tools/throughput.json

Every seed row that prints a throughput is listed: seed 001's Table 1 (images/s), seed 002's Table 1
(image/sec/core) and seed 004's Tables 1 and 8 (eval ms/img). A MoE row's paper ratio is MoE / dense throughput
against the dense row of the same table and backbone (for ms/img: dense ms / MoE ms). The measured ratio is
`moespec bench`'s median MoE / dense images/s on the row's spec and its dense backbone, an eval forward in fp32,
on this machine's CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = Path(__file__).resolve().parent / "throughput.json"

PRINTED = {
    1: "814", 2: "768", 3: "466", 4: "442", 5: "299", 6: "289", 7: "1100", 8: "1031", 9: "336", 10: "303",
    11: "1083", 12: "892", 13: "724", 14: "329", 15: "227",
    93: "861", 94: "268", 95: "3986", 96: "1320", 97: "412", 98: "3986", 99: "1265", 100: "482",
    162: "0.5", 163: "1.3", 164: "4.9", 165: "8.6", 166: "8.6", 167: "0.9", 168: "1.5", 169: "4.8",
    170: "0.5", 171: "0.7", 172: "0.7", 173: "0.9", 174: "0.9", 175: "1.3", 176: "1.5", 177: "4.9", 178: "4.8",
    179: "4.8", 180: "4.8", 181: "8.6", 182: "8.6", 183: "8.8", 184: "8.8", 185: "10.9", 186: "10.9",
}
"""Seed row id -> the throughput the seed prints (seed 001 im/s, seed 002 image/sec/core, seed 004 ms/img)."""
UNIT = {"001": "im/s", "002": "im/s/core", "004": "ms/img"}

DENSE_OF = {2: 1, 4: 3, 6: 5, 8: 7, 10: 9, 12: 11, 13: 11, 15: 14, 98: 95, 99: 96, 100: 97,
            168: 163, 169: 164, 171: 170, 172: 170, 176: 175, 178: 177, 179: 177, 180: 177,
            183: 181, 184: 181, 185: 181, 186: 181}
"""MoE row -> the dense row of its table whose throughput the paper's ratio divides by."""

MEASURED = {  # spec (as tools/reproduction.py names it) -> batch
    "convnext_t_moe4_last2_top1": 8, "convnext_s_moe4_last2_top1": 4, "convnext_b_moe4_last2_top1": 4,
    "vit_s16_moe8_last2_top2": 8, "vit_s16_moe8_every2_top2": 8, "vit_b16_moe8_every2_top2": 4,
    "sparse_mlp_s": 8, "sparse_mlp_b": 4, "seeds/softmoe_s16_e128_half_jft": 8,
}
ROUNDS, WARMUP = 10, 2

NOT_MEASURED = {
    7: "not a timm model: timm's ConvNeXt has four stages", 8: "not a timm model", 9: "not a timm model",
    10: "not a timm model",
    100: "moespec's Sparse-L is built on Mixer-B/16 at 14 blocks (tools/reproduction.py, row 100), so `bench`'s "
         "dense backbone is that model, not the paper's Mixer-L/16 (row 97)",
    167: "no dense S/14 in the paper's table", 173: "no dense S/14 in the paper's table",
    174: "no dense S/14 in the paper's table",
    **dict.fromkeys((168, 176), "3.7B parameters: 14.9 GB of fp32 weights with the 86M dense model beside them, "
                                "more than this shared 23 GB machine holds while two other test runs use it"),
    **dict.fromkeys((169, 178, 179, 180), "13.1B parameters: 52 GB of fp32 weights"),
    **dict.fromkeys((183, 184), "27.3B parameters: 109 GB of fp32 weights"),
    **dict.fromkeys((185, 186), "54.1B parameters: 216 GB of fp32 weights"),
}
"""MoE rows without a measurement here, and why."""


def measure(only: str | None = None) -> None:
    """`moespec bench` on each spec of MEASURED (or `only`), one at a time, each result added to RESULTS."""
    import reproduction  # tools/reproduction.py, beside this script: the specs by name

    from moespec.apps.bench import bench

    done = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    for spec, batch in MEASURED.items():
        if only is not None and spec != only:
            continue
        print(f"bench {spec} at batch {batch}", file=sys.stderr, flush=True)
        report = bench([reproduction.spec_path(spec)], batch=batch, rounds=ROUNDS, warmup=WARMUP).to_dict()
        report["results"][0]["source"] = str(reproduction.spec_path(spec).relative_to(ROOT))
        done[spec] = report
        with tempfile.NamedTemporaryFile("w", dir=RESULTS.parent, delete=False, suffix=".tmp") as tmp:
            tmp.write(json.dumps(done, indent=1, sort_keys=True) + "\n")
        os.replace(tmp.name, RESULTS)


def paper_ratio(row_id: int, seed: str) -> float | None:
    """MoE / dense throughput as the paper prints them (ms/img: dense ms / MoE ms)."""
    if row_id not in DENSE_OF:
        return None
    moe, dense = float(PRINTED[row_id]), float(PRINTED[DENSE_OF[row_id]])
    return dense / moe if seed == "004" else moe / dense


def section(rows: list[dict], spec_of) -> str:
    """The Throughput section of docs/reproduction.md: one line per seed row that prints a throughput. `spec_of(row)`
    is the spec name tools/reproduction.py counts the row with (or None)."""
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    first = next(iter(results.values()), None)
    lines = ["## Throughput", "", HEADER.strip(), ""]
    if first is not None:
        m = first["machine"]
        loads = sorted(r["machine"]["load_before"][0] for r in results.values()) + \
            sorted(r["machine"]["load_after"][0] for r in results.values())
        lines += [f"Measured on {m['cpu']}, {m['cores']} cores, {m['threads']} torch threads, torch {m['torch']}, "
                  f"CPU, fp32, an eval forward, {first['rounds']} rounds after {first['warmup']} warm-up, the batch in "
                  f"the table; 1-minute load average {min(loads):.1f} to {max(loads):.1f} over the runs (the machine "
                  f"was shared).", ""]
    lines += ["| id | seed | table | row | paper | dense row | paper MoE / dense | moespec bench MoE / dense (CPU) | "
              "images/s MoE / dense (CPU, batch) | GMACs MoE / dense | why not measured |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if row["id"] not in PRINTED:
            continue
        seed = row["seed"][:3]
        ratio = paper_ratio(row["id"], seed)
        spec = spec_of(row)
        result = results.get(spec, {}).get("results", [None])[0] if row["id"] in DENSE_OF else None
        measured = images = gmacs = ""
        if result is not None and row["id"] not in NOT_MEASURED:
            r = result["ratio"]
            measured = f"{r['median']:.2f} ({r['min']:.2f} - {r['max']:.2f})"
            images = (f"{result['moe_images_per_s']['median']:.2f} / {result['dense_images_per_s']['median']:.2f} "
                      f"(batch {results[spec]['batch']})")
            gmacs = f"{result['gmacs_ratio']:.2f}"
        role = "dense" if row["id"] not in DENSE_OF else f"{DENSE_OF[row['id']]}"
        lines.append(f"| {row['id']} | {seed} | {row['table'].split(' (')[0]} | {row['row']} | "
                     f"{PRINTED[row['id']]} {UNIT[seed]} | {role} | {'' if ratio is None else f'{ratio:.2f}'} | "
                     f"{measured} | {images} | {gmacs} | {NOT_MEASURED.get(row['id'], '')} |")
    return "\n".join([*lines, "", WHY.strip()])


HEADER = """
Seed 001 prints images/s, seed 002 image/sec/core and seed 004 eval ms/img; each MoE row's paper ratio is MoE / dense
throughput against the dense row named (for ms/img, dense ms / MoE ms). Beside it, `moespec bench`'s ratio for the
row's spec and its dense backbone: the median of the per-round ratios (min - max over the rounds), measured by
`python tools/throughput.py --measure` into `tools/throughput.json` on a 2-core CPU machine, not on the papers'
GPUs and TPUs: these are CPU figures. No GPU was available to measure on, so there are no GPU figures here.
"""

WHY = """
What the CPU figures say, and why some cannot match:

- **On this CPU an MoE model's time follows its counted MACs.** The efficiency (GMACs ratio / time ratio) of
  every pair measured but Soft MoE's is 0.95 to 1.03: the measured ratio is close to 1 / (GMACs ratio). The papers'
  ratios follow their own FLOP columns, which for the ViTs are larger than what the models they describe
  compute (note [b] above): seed 001 prints 6.9G against 4.6G for ViT-S Every 2, a ratio of 1.50 whose inverse,
  0.67, is its throughput ratio; moespec counts 6.01 against 4.61 GMACs (1.30), and bench measures 0.75. Likewise
  ViT-B Every 2 (26.3G / 17.5G = 1.50, throughput 0.69; counted 1.32, measured 0.75) and ViT-S Last 2
  (5.3G / 4.6G = 1.15, throughput 0.82; counted 1.10, measured 0.89). A ratio measured on the models as the
  paper describes them cannot reach a figure that follows the larger FLOPs.
- **ConvNeXt**: the MoE models have fewer MACs than the dense ones (0.95 to 0.97 counted), and the paper's GPU
  still ran them 3 to 6% slower (0.94 to 0.97: routing and dispatch cost more than the MACs saved there); on the
  CPU they run at 0.97 to 1.01, within the spread of the rounds.
- **Sparse-S** (seed 002): the paper prints the same 3986 image/sec/core for Mixer-S and Sparse-S (and the
  same 35.5 pre-training core-days), but Sparse-S as described rescales its two sparse blocks to twice the
  tokens: 5.34 GMACs against Mixer-S's 3.79 here (1.41), so no implementation of it can run at Mixer-S's speed
  without other changes the paper does not state; bench measures 0.73. Sparse-B (1.06 counted) measures 0.94
  against the paper's 0.96.
- **Soft MoE S/16** (seed 004): 0.93 of the dense model's GMACs, yet 0.71 of its speed on the paper's TPUv3
  (0.7 against 0.5 ms/img) and 0.82 here: the one pair whose efficiency is well below 1 on both (0.76 here). Its
  dispatch and combine (softmaxes over 196 tokens x 128 slots, two 196 x 128 x 384 products per MoE layer) and
  its 128 experts of one slot each are small, memory-bound operations on either device.
- The absolute images/s are not the papers' (a GPU or TPU at large batches against 2 shared CPU cores at
  batch 8 or 4, at 1-minute load averages up to 11 while other test runs shared the cores): only the ratios
  compare. A first run of 6 rounds, at load averages of 0.7 to 4.7, gave medians within 0.09 of these.
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="bench the measurable pairs into tools/throughput.json")
    parser.add_argument("--only", help="only this spec (a key of MEASURED)")
    args = parser.parse_args(argv)
    if args.measure:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        measure(args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())

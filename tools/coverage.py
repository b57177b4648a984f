"""Which timm model families moespec can turn into MoE models: the probe behind docs/coverage.md.

    python tools/coverage.py [--modules beit coat ...] [--timeout 120] [--jobs 2] [--markdown docs/coverage.md]
                             [--json out.json]

For every timm model module (`timm.list_modules()`), the smallest variant among its first models (fewest
parameters, counted on the meta device) gets the spec a new user would write; where that one does not come
through, the smallest-named variant of each other model family of the module is tried too (the family: the
name before its first `_`; MLP-Mixer's module holds `mixer`, `gmlp` and `resmlp`), one row per model tried.
The spec: its default input size, the
last 2 blocks, 4 experts, normalized top-1, no `sublayer`; a model whose default input is larger than 224 px
runs at 224 where it takes `img_size`. Each module runs in a subprocess with a timeout, through the
stages in order, and stops at the first that fails:

    plan      moespec.plan(spec): the blocks and FFNs found
    build     moespec.create_model(spec)
    forward   the model on one image of the model's input size
    train     one SGD step on cross-entropy + moespec.aux_loss (finite loss and gradients)
    upcycle   moespec.upcycle_with_report: identical experts behind a normalized top-1 router give the dense
              model's logits (<= 1e-5 relative, in eval mode)

The status is the last stage passed ("upcycle" = all), "refused" (plan refused the spec; the reason is the
plan's), or "timeout". The table lists the FFN classes the model defines (those with an adapter, and those
named like an FFN: `discovery.looks_like_ffn`), the MoE layers planned, and the reason of a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL_INPUT = 224  # the input side the probe uses where a model's default is larger and it takes img_size
CANDIDATES = 8  # models of a module compared for size (all of vision_transformer's 160 would take minutes)
SMALL_WORDS = ("atto", "femto", "pico", "nano", "tiny", "xxs", "xs", "small", "s_", "_s", "t_", "_t", "b0")


def _probe(module: str, model: str | None = None) -> dict:
    """Run in a subprocess: the probe of one timm module, with `model` or its smallest variant."""
    import math

    import timm
    import torch
    import torch.nn.functional as F

    import moespec
    from moespec.backbones.adapters import find_adapter
    from moespec.backbones.discovery import looks_like_ffn
    from moespec.errors import MoespecError
    from moespec.weights import upcycle_with_report

    torch.manual_seed(0)
    names = timm.list_models(module=module)
    if not names:
        return {"module": module, "model": "", "status": "none", "reason": "no models"}
    ranked = [model] if model is not None else sorted(names, key=_smallness)[:CANDIDATES]
    sizes = {}
    for name in ranked:
        try:
            with torch.device("meta"):
                sizes[name] = sum(p.numel() for p in timm.create_model(name).parameters())
        except Exception:  # noqa: BLE001 - a variant that does not build is skipped
            continue
    model_name = min(sizes, key=sizes.get) if sizes else ranked[0]
    row = {"module": module, "model": model_name, "status": "none", "ffn_classes": [], "blocks": 0, "reason": ""}
    try:
        with torch.device("meta"):
            dense = timm.create_model(model_name)
        ffns = sorted({type(m).__name__ for m in dense.modules() if find_adapter(m) is not None or looks_like_ffn(m)})
        row["ffn_classes"] = ffns
        size = list(dense.pretrained_cfg.get("input_size", (3, 224, 224)))
    except Exception as error:  # noqa: BLE001
        row.update(reason=f"timm build: {type(error).__name__}: {error}"[:300])
        return row
    spec = {"name": f"coverage-{module}", "backbone": {"model": model_name}, "input_size": size,
            "moe": [{"where": {"last": 2}, "experts": 4, "router": {"kind": "topk", "top_k": 1, "normalize": True}}]}
    if max(size[1:]) > SMALL_INPUT:  # Gemma 4 at 768 px: a minute per forward here; the small input if it takes it
        small = {**spec, "backbone": {"model": model_name, "kwargs": {"img_size": SMALL_INPUT}},
                 "input_size": [size[0], SMALL_INPUT, SMALL_INPUT]}
        try:
            moespec.plan(moespec.load_spec(small))
            spec, size = small, small["input_size"]
        except Exception:  # noqa: BLE001 - a model without img_size keeps its default input
            pass
    row["input_size"] = size
    start = time.perf_counter()
    try:
        plan = moespec.plan(moespec.load_spec(spec))
        row.update(status="plan", blocks=len(plan.layers), plan_s=round(time.perf_counter() - start, 1))
        model = moespec.create_model(moespec.load_spec(spec), seed=0)
        row["status"] = "build"
        x = torch.randn(1, *size)
        with torch.no_grad():
            model.eval()(x)
        row["status"] = "forward"
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        out = model(torch.randn(2, *size))
        logits = out if out.dim() == 2 else out.flatten(1)
        loss = F.cross_entropy(logits, torch.zeros(2, dtype=torch.long)) + moespec.aux_loss(model)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not math.isfinite(loss.item()) or not all(torch.isfinite(g).all() for g in grads):
            raise RuntimeError("non-finite loss or gradient")
        optimizer.step()
        row["status"] = "train"
        _, report = upcycle_with_report(moespec.load_spec(spec), seed=0)  # identical experts, gate 1
        row["upcycle_diff"] = report.max_abs_logit_diff / max(1.0, report.max_abs_logit)
        if not report.function_preserving:
            raise RuntimeError(f"the upcycled model is not the dense one: {report}".replace("\n", " "))
        row["status"] = "upcycle"
    except MoespecError as error:
        if row["status"] == "none":
            row.update(status="refused", plan_s=round(time.perf_counter() - start, 1))
        row["reason"] = str(error).splitlines()[0][:300]
    except Exception as error:  # noqa: BLE001 - the table reports it
        row["reason"] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    return row


def _smallness(name: str) -> tuple:
    """How a model name ranks among a module's for size, small first (by its words, then its length)."""
    return (not any(w in name for w in SMALL_WORDS), len(name), name)


def other_families(module: str, tried: str) -> list[str]:
    """The smallest-named variant of each model family of `module` other than `tried`'s (the family: the name
    before its first `_`), in name order."""
    import timm

    families: dict[str, list[str]] = {}
    for name in timm.list_models(module=module):
        families.setdefault(name.split("_")[0], []).append(name)
    mine = tried.split("_")[0]
    return [min(names, key=_smallness) for family, names in sorted(families.items()) if family != mine]


def probe(module: str, timeout: float, model: str | None = None) -> dict:
    """`_probe(module, model)` in a subprocess, with a timeout."""
    code = f"import json, sys; sys.path.insert(0, {str(ROOT / 'tools')!r}); import coverage; " \
           f"print(json.dumps(coverage._probe({module!r}, {model!r})))"
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as cache:  # a cold plan: nothing read from an earlier run's cache
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                                  cwd=ROOT, env={**os.environ, "MOESPEC_CACHE_DIR": cache})
    except subprocess.TimeoutExpired:
        return {"module": module, "model": model or "", "status": "timeout", "ffn_classes": [], "blocks": 0,
                "reason": f"no result in {timeout:.0f} s", "seconds": timeout}
    lines = done.stdout.strip().splitlines()
    try:
        row = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        row = {"module": module, "model": model or "", "status": "none", "ffn_classes": [], "blocks": 0,
               "reason": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def markdown(rows: list[dict], timm_version: str, torch_version: str) -> str:
    counts = {status: sum(r["status"] == status for r in rows)
              for status in ("upcycle", "train", "forward", "build", "plan", "refused", "none", "timeout")}
    modules = len({r["module"] for r in rows})
    lines = [
        "# timm coverage",
        "",
        f"Generated by `python tools/coverage.py --markdown docs/coverage.md` with timm {timm_version} and torch "
        f"{torch_version}: for every timm model module, its smallest variant with the spec a new user writes (the "
        "last 2 blocks, 4 experts, normalized top-1, no `sublayer`), at its default input size, or at 224 px where "
        "that is larger and the model takes `img_size` (the input column: the side in pixels); where that variant "
        "does not come through, the smallest-named variant of each other model family of the module too (MLP-Mixer's "
        "module holds `mixer`, `gmlp` and `resmlp`). One row per model tried. Status: the last "
        "stage passed (plan, build, forward, train: one SGD step, upcycle: the upcycled model's logits equal the "
        "dense model's), `refused` (the plan refused the spec), `timeout`, or `none` (failed before planning). "
        "Plan (s): the time to plan or "
        "refuse, cold (an empty plan cache; timm's build of the model on the meta device included).",
        "",
        f"{len(rows)} models of {modules} modules: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + ".",
        "",
        "| model | module | input | status | FFN classes | MoE layers | plan (s) | reason |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(markdown_row(r))
    return "\n".join(lines) + "\n"


KEPT = "<!-- written by hand: tools/coverage.py keeps everything below this line -->"


def kept_sections(path: Path) -> str:
    """The hand-written part of an existing page (from the KEPT line on), which a new table keeps."""
    text = path.read_text() if path.is_file() else ""
    return "\n" + text[text.index(KEPT):] if KEPT in text else ""


def markdown_row(r: dict) -> str:
    """One model's row of the table."""
    reason = r.get("reason", "").replace("|", "\\|")
    side = r.get("input_size", [0, 0, 0])[-1] or ""
    classes = ", ".join(r.get("ffn_classes", []))
    return (f"| {r['model']} | {r['module']} | {side} | {r['status']} | {classes} | {r.get('blocks', 0)} | "
            f"{r.get('plan_s', '')} | {reason} |")


def main() -> None:
    import timm
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", nargs="+", help="timm modules to probe (default: all)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per module")
    parser.add_argument("--jobs", type=int, default=2, help="modules probed at once")
    parser.add_argument("--markdown", type=Path, help="write the table here (docs/coverage.md)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args()
    modules = args.modules or timm.list_modules()
    rows = []
    def tried(module: str) -> list[dict]:  # the smallest variant; if it does not come through, each family's
        first = probe(module, args.timeout)
        others = other_families(module, first["model"]) if first["status"] != "upcycle" and first["model"] else []
        return [first, *(probe(module, args.timeout, model) for model in others)]

    with ThreadPoolExecutor(args.jobs) as pool:
        for found in pool.map(tried, modules):
            for row in found:
                rows.append(row)
                print(f"{row['module']:24s} {row['model']:40s} {row['status']:8s} {row.get('seconds', 0):6.1f} s  "
                      f"{row.get('reason', '')[:100]}", flush=True)
    if args.markdown:
        text = markdown(rows, timm.__version__, torch.__version__) + kept_sections(args.markdown)
        temp = args.markdown.with_suffix(".tmp")
        temp.write_text(text)
        temp.replace(args.markdown)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""The GPU figures of issue 35: the layer against its equal-FLOP dense FFN, the default step against the forced
ones, whole-model training-step efficiency (eager and compiled), and the host-sync check.

    python tools/bench_gpu.py [--quick] [--only layer|model|sync] [--compile SPEC ...] [--precision bf16 autocast]
                              [--family gelu swiglu] [--tokens 12608 50432] [--json out.json]

1. Layer (`layer`): d = 768, expert width 3072 (ViT-B), GELU experts with biases (timm's Mlp) and SwiGLU experts
   without (timm's SwiGLU, bias=False), E in {8, 32}, k in {1, 2}, T in {12608, 50432} (64 or 256 images of
   197 tokens); in bf16 weights ("bf16") and in fp32 weights under bf16 autocast ("autocast", what a training
   loop has). Each is timed against the dense FFN of its family with hidden width k * 3072 (equal activated
   FLOPs) built in the same precision: forward (no autograd) and forward+backward, CUDA-synchronized medians,
   interleaved. The default step ("auto") and each forced step (padded, grouped_mm, and triton where
   `available_steps` allows it: the scattered kernels of moespec/layers/ops/scattered.py) are timed, after a
   check that their outputs agree. A forced step that fails (an untried kernel) is reported and left out, not fatal.
2. Model (`model`): one training step (bf16 autocast, fused AdamW, cross-entropy + moespec.aux_loss) of
   vit_b16_moe8_every2_top2 at batch 128, vit_s16_moe8_every2_top2 at 256 and softmoe_s16_e128_half at 256,
   against its dense backbone; efficiency = (activated-FLOP ratio from `moespec stats`) / (time ratio).
   `--compile SPEC` also times the torch.compile'd pair of that spec.
3. Sync (`sync`): forward and backward of every layer kind in training mode under
   `torch.cuda.set_sync_debug_mode("error")` (CUDA only), and of top-k with the triton step forced.
`--quick`: small sizes, for a check on CPU. Figures only: nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from timm.layers import Mlp, SwiGLU
from torch import nn

import moespec
from moespec.backbones import create_backbone
from moespec.layers import (
    ExpertChoiceRouter,
    Experts,
    ImageRouter,
    LinearGate,
    MoE,
    SoftMoE,
    TopKRouter,
    available_steps,
    set_expert_step,
)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(fns: dict, repeats: int, device, warmup: int = 2) -> dict[str, float]:
    """Median ms of each fn, called in rotating order so that drift hits them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            _sync(device)
            start = time.perf_counter()
            fns[name]()
            _sync(device)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _layers(family: str, experts: int, top_k: int, dim: int, hidden: int):
    if family == "gelu":
        bank = Experts(experts, dim, hidden, dim, act=nn.GELU())
        dense = Mlp(dim, top_k * hidden)
    else:
        bank = Experts(experts, dim, hidden, dim, act=nn.SiLU(), glu="act_first", bias=(False, False))
        dense = SwiGLU(dim, top_k * hidden, bias=False)
    return MoE(TopKRouter(LinearGate(dim, experts), experts, top_k), bank), dense


def _forward(module, x):
    with torch.no_grad():
        module(x)


def _train(module, x):
    module(x).float().square().mean().backward()
    for p in module.parameters():
        p.grad = None


def layer_bench(device, quick: bool, precisions=("bf16", "autocast"), families=("gelu", "swiglu"),
                tokens_list=(12608, 50432)) -> list[dict]:
    dim, hidden = (64, 256) if quick else (768, 3072)
    token_counts = (128 * 4,) if quick else tokens_list
    repeats = 3 if quick else 15
    rows = []
    for precision in precisions:
        for family in families:
            for experts in (8, 32):
                for top_k in (1, 2):
                    for tokens in token_counts:
                        rows.append(_layer_setting(device, precision, family, experts, top_k, tokens, dim, hidden,
                                                   repeats))
    return rows


def _layer_setting(device, precision, family, experts, top_k, tokens, dim, hidden, repeats) -> dict:
    torch.manual_seed(0)
    moe, dense = _layers(family, experts, top_k, dim, hidden)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    moe, dense = moe.to(device, dtype), dense.to(device, dtype)
    x = torch.randn(tokens, dim, device=device, dtype=dtype)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "autocast")
    triton = "triton" in available_steps(device, torch.bfloat16)
    steps = ["auto", "padded", "grouped_mm"] + (["triton"] if triton else [])
    failed = {}
    with autocast:
        outputs = {}
        for step in list(steps):
            set_expert_step(moe.experts, step)
            try:
                with torch.no_grad():
                    outputs[step] = moe(x).float()
                _train(moe, x)
            except Exception as error:  # noqa: BLE001 -- an untried step must not end the run: report it
                failed[step] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                steps.remove(step)
                print(f"layer {precision} {family} E={experts} k={top_k} T={tokens}: step {step} failed: "
                      f"{failed[step]}", flush=True)
        scale = outputs["padded"].abs().max().item()
        agree_by_step = {s: (outputs[s] - outputs["padded"]).abs().max().item() / scale for s in steps}
        agree = max(agree_by_step.values())
        forward, train = {"dense": lambda: _forward(dense, x)}, {"dense": lambda: _train(dense, x)}
        for step in steps:
            forward[step] = (lambda s=step: (setattr(moe.experts, "dispatch", s), _forward(moe, x)))
            train[step] = (lambda s=step: (setattr(moe.experts, "dispatch", s), _train(moe, x)))
        fwd, both = interleaved(forward, repeats, device), interleaved(train, repeats, device)
    row = {"precision": precision, "family": family, "E": experts, "k": top_k, "T": tokens, "agree": agree,
           "agree_by_step": agree_by_step, "failed": failed,
           "fwd": {s: fwd[s] / fwd["dense"] for s in steps}, "fwd_bwd": {s: both[s] / both["dense"] for s in steps},
           "dense_ms": {"fwd": fwd["dense"], "fwd_bwd": both["dense"]}}
    best_f = min(row["fwd_bwd"][s] for s in steps[1:])
    print(f"layer {precision:8s} {family:6s} E={experts:2d} k={top_k} T={tokens:5d}  fwd " +
          " ".join(f"{s} {row['fwd'][s]:.2f}" for s in steps) + " | fwd+bwd " +
          " ".join(f"{s} {row['fwd_bwd'][s]:.2f}" for s in steps) +
          f" | auto/best {row['fwd_bwd']['auto'] / best_f:.3f} | dense {fwd['dense']:.2f}/{both['dense']:.2f} ms"
          f" | agree {agree:.1e}", flush=True)
    return row


MODELS = (("vit_b16_moe8_every2_top2", 128), ("vit_s16_moe8_every2_top2", 256), ("softmoe_s16_e128_half", 256))


def model_bench(device, quick: bool, compiled: list[str]) -> list[dict]:
    rows = []
    for name, batch in MODELS:
        spec = moespec.load_spec(f"specs/{name}.yaml")
        kwargs = {}
        if quick:
            kwargs = {"img_size": 32, "embed_dim": 64, "num_heads": 2}
            spec = spec.model_copy(update={"input_size": (3, 32, 32), "backbone": spec.backbone.model_copy(
                update={"kwargs": {**spec.backbone.kwargs, **kwargs}})})
            batch = 4
        stats = moespec.stats(spec)
        flop_ratio = stats.gmacs / stats.dense_gmacs
        for mode in ("eager", "compiled") if name in compiled else ("eager",):
            models = {"dense": create_backbone(spec).to(device), "moe": moespec.create_model(spec, seed=0).to(device)}
            x = torch.randn(batch, *spec.input_size, device=device)
            y = torch.randint(0, 10, (batch,), device=device)
            steps = {}
            for key, model in models.items():
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
                run = torch.compile(model) if mode == "compiled" else model
                steps[key] = _model_step(run, model, optimizer, x, y, device)
            start = time.perf_counter()
            ms = interleaved(steps, 3 if quick else 10, device, warmup=3)
            time_ratio = ms["moe"] / ms["dense"]
            row = {"spec": name, "batch": batch, "mode": mode, "dense_img_s": batch / ms["dense"] * 1e3,
                   "moe_img_s": batch / ms["moe"] * 1e3, "time_ratio": time_ratio, "flop_ratio": flop_ratio,
                   "efficiency": flop_ratio / time_ratio}
            print(f"model {name:26s} {mode:8s} batch {batch}: dense {row['dense_img_s']:.0f} img/s, moe "
                  f"{row['moe_img_s']:.0f} img/s, time ratio {time_ratio:.3f}, FLOP ratio {flop_ratio:.3f}, "
                  f"efficiency {row['efficiency']:.2f} ({time.perf_counter() - start:.0f} s)", flush=True)
            rows.append(row)
    return rows


def _model_step(run, model, optimizer, x, y, device):
    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(run(x), y) + moespec.aux_loss(model).to(device)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _kinds(dim: int) -> dict:
    bank = lambda: Experts(4, dim, 4 * dim, dim, act=nn.GELU())  # noqa: E731
    gate = lambda: LinearGate(dim, 4)  # noqa: E731
    return {"topk2": lambda: MoE(TopKRouter(gate(), 4, 2), bank()),
            "topk-capacity-bpr": lambda: MoE(TopKRouter(gate(), 4, 1, capacity_factor=1.0, bpr=True), bank()),
            "topk-drop": lambda: MoE(TopKRouter(gate(), 4, 2, drop_fraction=0.25), bank()),
            "image": lambda: MoE(ImageRouter(gate(), 4, 2), bank()),
            "expert_choice": lambda: MoE(ExpertChoiceRouter(gate(), 4), bank()),
            "soft": lambda: SoftMoE(bank(), 2)}


def _forced(layer: MoE, step: str) -> MoE:
    set_expert_step(layer.experts, step)
    return layer


def sync_check(device) -> dict[str, str]:
    results = {}
    kinds = _kinds(64)
    if "triton" in available_steps(device, torch.bfloat16):
        kinds["topk2-triton"] = lambda: _forced(kinds["topk2"](), "triton")
    for name, make in kinds.items():
        layer = make().to(device).train()
        layer.aux_loss_weights = {"switch": 0.01}
        x = torch.randn(8, 17, 64, device=device, requires_grad=True)
        for precision in ("fp32", "autocast"):
            try:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "autocast"):
                    layer(x)  # the first call may set things up
                    if device.type == "cuda":
                        torch.cuda.set_sync_debug_mode("error")
                    y = layer(x)
                    loss = y.float().sum() + sum(getattr(layer, "computed_aux_losses", {}).values(), 0)
                loss.backward()
                results[f"{name}/{precision}"] = "no sync"
            except Exception as error:  # noqa: BLE001 -- a sync or an untried kernel's failure: report, go on
                results[f"{name}/{precision}"] = f"SYNC: {str(error).splitlines()[0][:120]}"
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
            print(f"sync {name:18s} {precision:8s} {results[f'{name}/{precision}']}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", choices=["layer", "model", "sync"], action="append")
    parser.add_argument("--compile", nargs="*", default=[], help="specs whose compiled step is timed too")
    parser.add_argument("--precision", nargs="+", default=["bf16", "autocast"], choices=["bf16", "autocast"])
    parser.add_argument("--family", nargs="+", default=["gelu", "swiglu"], choices=["gelu", "swiglu"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[12608, 50432])
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    only = set(args.only or ["sync", "layer", "model"])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}", flush=True)
    figures = {"device": name, "torch": torch.__version__}
    if "sync" in only:
        figures["sync"] = sync_check(device)
    if "layer" in only:
        figures["layer"] = layer_bench(device, args.quick, args.precision, args.family, args.tokens)
    if "model" in only:
        figures["model"] = model_bench(device, args.quick, args.compile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()

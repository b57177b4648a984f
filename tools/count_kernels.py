"""The kernels a GPU launches for one step of a top-k MoE layer, counted on CPU along the GPU path
(`moespec.layers.device_path()`), no GPU needed: at most 15 in forward and 25 in forward+backward:

    python tools/count_kernels.py          # the table of docs/gpu.md; --list prints each kernel of each step

Every op that computes is counted (no views, no metadata), each moespec custom op as the kernels it launches on
CUDA (`CUDA_KERNELS`: one, but for the pairs' two). The layer's aux losses are counted (`--losses`: none, a
spec's default, Switch + z-loss; its forward computes them, as a training step's does); the task loss's ops are
not: backward starts from a given output gradient and the aux loss's. Each step runs in a fresh autocast region,
as a training step does (autocast casts each weight again). tests/layers/test_pairs.py asserts the bounds with
`step_kernels`: without aux losses, as issue 46 set them; docs/gpu.md says what the losses add and why.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moespec.layers import Experts, LinearGate, MoE, TopKRouter, device_path  # noqa: E402

CUDA_KERNELS = {"moespec.sort_pairs.default": 2}  # a histogram per block of choices, then every choice's row
"""Kernels a moespec op launches on CUDA, where not one (`layers/kernels/pairs.py`)."""
NOT_KERNELS = {"aten.detach.default", "aten.promote_types.default"}


class Kernels(TorchDispatchMode):
    """The kernels a GPU would launch for the ops that run under it, by name, in order."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aliases = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if not aliases and str(func) not in NOT_KERNELS:
            self.ops += [str(func)] * CUDA_KERNELS.get(str(func), 1)
        return func(*args, **(kwargs or {}))


LOSSES = {"none": {}, "default": {"importance_load": 0.01}, "switch+z": {"switch": 0.01, "z_loss": 0.001}}
"""The aux losses a step computes: none, a spec's default (importance_load at 0.01), Switch's with ST-MoE's z-loss."""


def layer(top_k: int, kind: str, dtype: torch.dtype, experts: int = 8, dim: int = 32, losses: str = "none") -> MoE:
    """A top-k MoE layer in training mode: GELU experts with biases, or SwiGLU experts without; with the aux
    losses `LOSSES[losses]`, which its forward computes (as a training step's does)."""
    torch.manual_seed(0)
    options = {"glu": "act_first", "bias": (False, False)} if kind == "swiglu" else {}
    bank = Experts(experts, dim, 2 * dim, dim, act=nn.SiLU() if kind == "swiglu" else nn.GELU(), **options)
    moe = MoE(TopKRouter(LinearGate(dim, experts), experts, top_k), bank,
              aux_loss_weights=LOSSES[losses]).to(dtype).train()
    for p in moe.parameters():  # away from the init's zeros, so that every parameter matters
        p.data.add_(torch.randn_like(p) * 0.05)
    return moe


def step_kernels(moe: MoE, x: torch.Tensor, autocast: bool) -> tuple[list[str], list[str]]:
    """(forward, backward) kernels of one step of `moe` on `x` along the GPU path, under bf16 autocast or not:
    the forward with its weighted aux loss, the backward from the output's gradient and the aux loss's."""
    with device_path():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), Kernels() as forward:
            y = moe(x)
            aux = moe.weighted_aux_loss()
        outputs, grads = ([y, aux], [torch.randn_like(y), torch.ones_like(aux)]) if aux is not None else \
            ([y], [torch.randn_like(y)])
        with Kernels() as backward:
            torch.autograd.backward(outputs, grads)
    return forward.ops, backward.ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print each kernel of each step")
    parser.add_argument("--losses", nargs="+", choices=list(LOSSES), default=list(LOSSES),
                        help="the aux losses to count with (default: each)")
    args = parser.parse_args()
    print(f"{'experts':8s} {'k':>2s} {'weights':22s} {'aux losses':10s} {'forward':>8s} {'backward':>9s} "
          f"{'total':>6s}")
    for kind in ("gelu", "swiglu"):
        for top_k in (1, 2):
            for autocast in (False, True):
                for losses in args.losses:
                    dtype = torch.float32 if autocast else torch.bfloat16
                    x = torch.randn(200, 32, dtype=dtype, requires_grad=True)
                    forward, backward = step_kernels(layer(top_k, kind, dtype, losses=losses), x, autocast)
                    weights = "fp32 under bf16 autocast" if autocast else "bf16"
                    print(f"{kind:8s} {top_k:2d} {weights:22s} {losses:10s} {len(forward):8d} {len(backward):9d} "
                          f"{len(forward) + len(backward):6d}")
                    if args.list:
                        print("   forward:  " + ", ".join(forward) + "\n   backward: " + ", ".join(backward))


if __name__ == "__main__":
    main()

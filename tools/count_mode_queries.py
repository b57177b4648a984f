"""How often one MoE layer call asks torch how it is running, counted on CPU (issue 58, point 2):

    python tools/count_mode_queries.py        # calls per forward+backward of a top-k layer, eagerly and along
                                              # the GPU path (`device_path()`), and where in moespec they come from

A query is a call, from moespec's code, of a mode predicate: whether torch.compile, torch.export or a TorchScript
trace is running, whether autocast is on and in which dtype, whether the layer runs the sync-free path, whether
the Triton kernels or torch's grouped matmul are there, whether autograd records. A predicate that asks another
counts once; an op's own test of its tensors' device and dtype is counted apart. The layer is
tools/count_kernels.py's: E = 8, k = 2, GELU experts with biases, d = 32, 64 items, fp32, in training mode.
"""

from __future__ import annotations

import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from count_kernels import layer  # noqa: E402

import moespec  # noqa: E402

PACKAGE = os.path.dirname(moespec.__file__)
PREDICATES = {
    # torch's own questions
    "is_tracing", "is_compiling", "is_exporting", "is_autocast_enabled", "get_autocast_dtype",
    # moespec's, before and after issue 58
    "sync_free", "exporting", "traced", "autocast_dtype", "_kernels", "_on_kernels", "has_grouped_mm",
    "fused_routing", "_inductor_sees", "_records_graph", "_grouped", "_plain_state", "on_device", "of",
    "_autocast_dtype",
}
OWN_TESTS = {"_kernels", "_on_kernels", "on_device", "_grouped"}
"""An op's own test of its tensors' device and dtype (the kernels run on CUDA in at most 32 bits; grouped_mm takes
fp32 / bf16 / fp16 with 16-byte strides): asked of the tensors, not of how the call runs."""


def _is_predicate(code) -> bool:
    if code.co_name not in PREDICATES:
        return False
    return code.co_name != "of" or code.co_filename.endswith(os.path.join("ops", "mode.py"))


def count(run) -> collections.Counter:
    """Queries made while `run()` runs, by (moespec file:line, predicate)."""
    counts: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            code, caller = frame.f_code, frame.f_back
        elif event == "c_call":
            code, caller = None, frame
            name = getattr(arg, "__name__", "")
            if name not in ("is_autocast_enabled", "get_autocast_dtype"):
                return
        else:
            return
        if code is not None and not _is_predicate(code):
            return
        if caller is None or not caller.f_code.co_filename.startswith(PACKAGE) or _is_predicate(caller.f_code):
            return
        where = f"{os.path.relpath(caller.f_code.co_filename, PACKAGE)}:{caller.f_lineno}"
        counts[(where, code.co_name if code is not None else arg.__name__)] += 1

    torch.autograd.set_multithreading_enabled(False)  # backward on this thread, where the profile function is
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        torch.autograd.set_multithreading_enabled(True)
    return counts


def main() -> None:
    try:
        from moespec.layers import device_path
    except ImportError:  # before the mode record
        from moespec.layers.dispatch import device_path
    moe = layer(2, "gelu", torch.float32)
    x = torch.randn(64, 32, requires_grad=True)

    def step():
        moe(x).square().sum().backward()

    step()  # warm: first calls import and register
    for title, context in (("CPU, eagerly", None), ("the GPU path on CPU (device_path)", device_path)):
        if context is None:
            counts = count(step)
        else:
            with context():
                counts = count(step)
        own = sum(n for (_, name), n in counts.items() if name in OWN_TESTS)
        print(f"{title}: {sum(counts.values())} queries in one forward+backward, {own} of them an op's own test of "
              f"its tensors' device and dtype")
        for (where, name), n in sorted(counts.items()):
            print(f"  {n:3d}  {name:22s} {where}")


if __name__ == "__main__":
    main()

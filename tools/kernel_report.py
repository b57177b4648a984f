"""Registers, spills and shared memory of the triton step's scattered kernels (`layers/kernels/scattered.py`), of
the grouped step's `bias_act` kernels (`layers/kernels/bias_act.py`) and of the routing and combine kernels
(`layers/kernels/pairs.py`), compiled for a Hopper GPU (sm_90) on any machine, no GPU needed:

    python tools/kernel_report.py            # the launches of a ViT-B layer (d = 768, expert width 3072), bf16

Each kernel is compiled as a real launch specializes it: its config from `kernels.scattered.CONFIGS` (or its
module's), its flags, and the divisibility hints Triton adds at a launch (every pointer 16-byte aligned, every integer
argument that is a multiple of 16 marked so, an integer equal to 1 made a constant). ptxas' own report (`-v`)
gives the registers, the spill stores and loads, and the stack frame. tests/layers/test_triton_step.py asserts
that no kernel spills.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moespec.layers.kernels import bias_act, pairs, scattered  # noqa: E402

INDEX_POINTERS = {"order_ptr", "a_order_ptr", "b_order_ptr", "expert_ptr"}  # int64
FP32_POINTERS = {"gate_ptr", "dgate_ptr", "dy_ptr"}  # gates and the output gradient under fp32 gates
FP32_POINTERS_OF = {"_bias_act_kernel": {"bias_ptr"},  # bias_act reads fc1's fp32 bias under autocast
                    "_bias_act_backward_kernel": {"bias_ptr"}}
POINTERS_OF = {  # the route kernels' pointers that are not of the element type: fp32, int64 and int32 tensors
    "_softmax_topk_kernel": {"probs_ptr": "*fp32", "weights_ptr": "*fp32", "experts_ptr": "*i64"},
    "_softmax_topk_backward_kernel": {"grad_probs_ptr": "*fp32", "grad_weights_ptr": "*fp32", "probs_ptr": "*fp32",
                                      "experts_ptr": "*i64"},
    "_pairs_histogram_kernel": {"experts_ptr": "*i64", "histogram_ptr": "*i32"},
    "_pairs_place_kernel": {"experts_ptr": "*i64", "weights_ptr": "*fp32", "histogram_ptr": "*i32",
                            "item_ptr": "*i64", "row_expert_ptr": "*i64", "pair_weights_ptr": "*fp32",
                            "position_ptr": "*i64", "counts_ptr": "*i64", "ends_ptr": "*i32"},
    "_combine_kernel": {"gates_ptr": "*fp32", "position_ptr": "*i64", "experts_ptr": "*i64", "bias_ptr": "*fp32"},
    "_combine_backward_kernel": {"gates_ptr": "*fp32", "position_ptr": "*i64", "experts_ptr": "*i64",
                                 "bias_ptr": "*fp32", "grad_gates_ptr": "*fp32"},
}
ABSENT = {"GATHER": ["order_ptr"], "SCATTER": ["order_ptr"], "HAS_BIAS": ["b_ptr"], "HAS_GATE": ["gate_ptr"],
          "A_GATHER": ["a_order_ptr"], "B_GATHER": ["b_order_ptr"], "SCALE_A": ["gate_ptr"], "BIAS_GRAD": ["bias_ptr"]}


def launches(dim: int = 768, hidden: int = 3072, experts: int = 8, top_k: int = 2, tokens: int = 50432) -> list:
    """(label, kernel, config name, flags, integer arguments by name) of one forward and backward of a top-k layer
    with GELU experts and biases: the flags and the integers that `kernels.scattered` passes."""
    rows = tokens * top_k
    common = {"rows": rows, "experts": experts, "top_k": top_k}
    return [
        ("fc1", scattered._fc1_kernel, "fc1", {"GATHER": True, "HAS_BIAS": True, "SAVE_PRE": True, "ACT": 0, "GLU": 0},
         {**common, "in_features": dim, "hidden": hidden, "stride_x": dim, "stride_we": hidden * dim,
          "stride_wn": dim, "stride_be": hidden, "stride_pre": hidden, "stride_h": hidden}),
        ("fc1 swiglu", scattered._fc1_kernel, "fc1", {"GATHER": True, "HAS_BIAS": False, "SAVE_PRE": True, "ACT": 1,
                                                  "GLU": 1},
         {**common, "in_features": dim, "hidden": hidden, "stride_x": dim, "stride_we": 2 * hidden * dim,
          "stride_wn": dim, "stride_be": 0, "stride_pre": 2 * hidden, "stride_h": hidden}),
        ("fc2", scattered._rows_kernel, "fc2", {"SCATTER": True, "HAS_BIAS": True, "HAS_GATE": True},
         {**common, "in_features": hidden, "out_features": dim, "stride_a": hidden, "stride_we": dim * hidden,
          "stride_wn": hidden, "stride_wk": 1, "stride_be": dim, "stride_out": dim}),
        ("fc2 backward", scattered._fc2_backward_kernel, "fc2_backward", {"GATHER": True, "HAS_GATE": True, "ACT": 0,
                                                                      "GLU": 0},
         {**common, "out_features": dim, "hidden": hidden, "stride_dy": dim, "stride_we": dim * hidden,
          "stride_wk": hidden, "stride_pre": hidden, "stride_dpre": hidden, "stride_dgate": hidden // 128}),
        ("fc2 backward swiglu", scattered._fc2_backward_kernel, "fc2_backward", {"GATHER": True, "HAS_GATE": True,
                                                                             "ACT": 1, "GLU": 1},
         {**common, "out_features": dim, "hidden": hidden, "stride_dy": dim, "stride_we": dim * hidden,
          "stride_wk": hidden, "stride_pre": 2 * hidden, "stride_dpre": 2 * hidden, "stride_dgate": hidden // 128}),
        ("fc1 backward", scattered._rows_kernel, "fc1_backward",
         {"SCATTER": True, "HAS_BIAS": False, "HAS_GATE": False},
         {**common, "in_features": hidden, "out_features": dim, "stride_a": hidden, "stride_we": hidden * dim,
          "stride_wn": 1, "stride_wk": dim, "stride_be": 0, "stride_out": dim}),
        ("fc1, flags off", scattered._fc1_kernel, "fc1", {"GATHER": False, "HAS_BIAS": False, "SAVE_PRE": False,
                                                      "ACT": 1, "GLU": 0},
         {**common, "top_k": 1, "in_features": dim, "hidden": hidden, "stride_x": dim, "stride_we": hidden * dim,
          "stride_wn": dim, "stride_be": 0, "stride_pre": hidden, "stride_h": hidden}),
        ("fc2, flags off", scattered._rows_kernel, "fc2", {"SCATTER": False, "HAS_BIAS": False, "HAS_GATE": False},
         {**common, "in_features": hidden, "out_features": dim, "stride_a": hidden, "stride_we": dim * hidden,
          "stride_wn": hidden, "stride_wk": 1, "stride_be": 0, "stride_out": dim}),
        ("fc2 backward, flags off", scattered._fc2_backward_kernel, "fc2_backward",
         {"GATHER": False, "HAS_GATE": False, "ACT": 1, "GLU": 2},
         {**common, "top_k": 1, "out_features": dim, "hidden": hidden, "stride_dy": dim, "stride_we": dim * hidden,
          "stride_wk": hidden, "stride_pre": 2 * hidden, "stride_dpre": 2 * hidden, "stride_dgate": 0}),
        ("outer, flags off", scattered._outer_kernel, "outer",
         {"A_GATHER": False, "B_GATHER": False, "SCALE_A": False, "BIAS_GRAD": False},
         {"a_div": 1, "b_div": 1, "m_size": dim, "n_size": hidden, "stride_a": dim, "stride_b": hidden,
          "stride_oe": dim * hidden, "stride_om": hidden, "stride_bias": 0}),
        ("outer (fp32 weight gradients)", scattered._outer_kernel, "outer",
         {"A_GATHER": True, "B_GATHER": False, "SCALE_A": True, "BIAS_GRAD": True},
         {"a_div": top_k, "b_div": 1, "m_size": dim, "n_size": hidden, "stride_a": dim, "stride_b": hidden,
          "stride_oe": dim * hidden, "stride_om": hidden, "stride_bias": dim}),
        *bias_act_launches(hidden, experts, rows),
        *route_launches(dim, experts, top_k, tokens),
    ]


def bias_act_launches(hidden: int, experts: int, rows: int) -> list:
    """The grouped step's `bias_act` kernels (`layers/kernels/bias_act.py`), forward and backward, GELU and SwiGLU."""
    found = []
    for label, act, glu in (("gelu", 0, 0), ("swiglu", 1, 1)):
        wide = hidden * (2 if glu else 1)
        common = {"rows": rows, "hidden": hidden, "experts": experts, "stride_pre": wide, "stride_bias": wide}
        found += [(f"bias_act {label}", bias_act._bias_act_kernel, bias_act.CONFIG, {"ACT": act, "GLU": glu},
                   {**common, "stride_h": hidden}),
                  (f"bias_act backward {label}", bias_act._bias_act_backward_kernel, bias_act.CONFIG,
                   {"ACT": act, "GLU": glu}, {**common, "stride_grad": hidden, "stride_dpre": wide})]
    return found


def route_launches(dim: int, experts: int, top_k: int, tokens: int) -> list:
    """The routing and combine kernels (`layers/kernels/pairs.py`) as `launch_*` configures them: the softmax and
    top k of the router's logits and its backward, the two kernels of the pairs' sort, and the combine of bf16
    expert outputs with fp32 gates and bias, forward and backward."""
    rows, softmax = tokens * top_k, pairs.softmax_topk_config(experts)
    route = {name: value for name, value in pairs.PAIRS_CONFIG.items() if name != "BLOCK_B"}
    sizes = {"rows": tokens, "num_experts": experts, "top_k": top_k}
    combine = {"items": tokens, "columns": dim, "top_k": top_k, "stride_out": dim, "stride_bias": dim}
    return [
        ("softmax top-k", pairs._softmax_topk_kernel, softmax, {}, sizes),
        ("softmax top-k backward", pairs._softmax_topk_backward_kernel, softmax,
         {"HAS_GRAD_PROBS": True, "HAS_GRAD_WEIGHTS": True}, sizes),
        ("softmax top-k backward, weights", pairs._softmax_topk_backward_kernel, softmax,
         {"HAS_GRAD_PROBS": False, "HAS_GRAD_WEIGHTS": True}, sizes),
        ("pairs histogram", pairs._pairs_histogram_kernel, route, {},
         {"choices": rows, "num_experts": experts}),
        ("pairs place", pairs._pairs_place_kernel, route,
         {"BLOCK_B": pairs.PAIRS_CONFIG["BLOCK_B"]},
         {"choices": rows, "num_experts": experts, "blocks": -(-rows // route["BLOCK_P"]), "top_k": top_k}),
        ("combine", pairs._combine_kernel, pairs.COMBINE_CONFIG,
         {"HAS_GATES": True, "HAS_BIAS": True}, {**combine, "stride_y": dim}),
        ("combine, flags off", pairs._combine_kernel, pairs.COMBINE_CONFIG,
         {"HAS_GATES": False, "HAS_BIAS": False}, {**combine, "stride_y": dim}),
        ("combine backward", pairs._combine_backward_kernel, pairs.combine_backward_config(top_k),
         {"HAS_BIAS": True, "NEED_OUT": True, "NEED_GATES": True},
         {**combine, "stride_grad": dim, "stride_grad_out": dim}),
        ("combine backward, gates only", pairs._combine_backward_kernel,
         pairs.combine_backward_config(top_k), {"HAS_BIAS": False, "NEED_OUT": False, "NEED_GATES": True},
         {**combine, "stride_grad": dim, "stride_grad_out": dim}),
    ]


def _config(config_name: str | dict, dtype: torch.dtype) -> dict:
    """A kernel's config: `kernels.scattered`'s by name, or the config itself (`bias_act.CONFIG`)."""
    return dict(config_name) if isinstance(config_name, dict) else scattered._config(config_name, dtype)


def compile_for_hopper(kernel, config_name: str, flags: dict, integers: dict, dtype: torch.dtype = torch.bfloat16):
    """The kernel compiled for sm_90 as a launch with these flags and integers specializes it."""
    import triton
    from triton.backends.compiler import GPUTarget

    config = _config(config_name, dtype)
    options = {k: config.pop(k) for k in ("num_warps", "num_stages") if k in config}
    if kernel is scattered._outer_kernel:
        config.pop("GROUP_M", None)
    element = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    absent = {name for flag, on in flags.items() if not on for name in ABSENT.get(flag, [])}
    constants = {**flags, **config}
    if "PRECISION" in inspect.signature(kernel.fn).parameters:  # the matmul kernels' (bias_act has no tl.dot)
        constants["PRECISION"] = "ieee"
    signature, attrs = {}, {}
    for index, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in constants:
            signature[name] = "constexpr"
        elif name in absent:  # `kernels.scattered._launch` passes an absent pointer as the int 0
            signature[name] = "i32"
        elif name.endswith("_ptr"):
            fp32 = name in FP32_POINTERS or name in FP32_POINTERS_OF.get(kernel.fn.__name__, ())
            signature[name] = POINTERS_OF.get(kernel.fn.__name__, {}).get(name) or (
                "*i32" if name == "offsets_ptr" else "*i64" if name in INDEX_POINTERS
                else "*fp32" if fp32 else f"*{element}")
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            value = integers.get(name, 16 * 1000)  # row_blocks and the like: a multiple of 16 or not, as it falls
            if value == 1:
                signature[name] = "constexpr"
                constants[name] = 1
            else:
                signature[name] = "i32"
                if value % 16 == 0:
                    attrs[(index,)] = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_report(compiled) -> dict[str, int]:
    """registers, spill_stores, spill_loads (bytes), stack (bytes) and shared (bytes) of a compiled kernel, from
    ptxas -v on its PTX (Triton's own ptxas)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        run = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(folder, "k.o")],
                             capture_output=True, text=True, check=True)
    text = run.stdout + run.stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, text)
        return int(found.group(1)) if found else 0

    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "stack": number(r"(\d+) bytes stack frame"),
            "shared": compiled.metadata.shared}


def main() -> None:
    print(f"{'kernel':32s} {'config':44s} {'regs':>5s} {'spill st/ld B':>14s} {'stack B':>8s} {'smem KB':>8s}")
    for label, kernel, config_name, flags, integers in launches():
        report = ptxas_report(compile_for_hopper(kernel, config_name, flags, integers))
        config = _config(config_name, torch.bfloat16)
        blocks = "x".join(str(value) for name, value in config.items() if name.startswith("BLOCK_"))
        shape = f"{blocks} w{config['num_warps']} s{config.get('num_stages', '-')} g{config.get('GROUP_M', 1)}"
        print(f"{label:32s} {shape:44s} {report['registers']:5d} "
              f"{report['spill_stores']:6d}/{report['spill_loads']:<7d} {report['stack']:8d} "
              f"{report['shared'] / 1024:8.1f}")


if __name__ == "__main__":
    main()

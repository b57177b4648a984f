"""The torch ops below the expert steps: each one a function of tensors and plain flags, with its torch fallback
where it has Triton kernels (`backend.py` is the one place that imports `layers/kernels/`; nothing here imports
Triton). How a layer call runs is decided once, above, as a `mode.Mode`, and reaches these ops as arguments.

    mode             how one layer call runs (`Mode`), `device_path()`: the one file that asks torch
    grouped          the jagged expert matmuls (`F.grouped_mm`, or one matmul per segment)
    expert_autograd  every expert's linear map at once, the pairs' gather and combine, the loop's segment graphs
    pairs            routing and the combine as custom ops: softmax + top-k, the pairs sorted by expert, combine
    bias_act         fc1's bias and the activation in one op (the grouped step)
    scattered        the scattered expert FFN of the forced triton step
    activations      the activation names and GLU orders these ops know
    collectives      the differentiable all-to-all and all-reduce of expert parallelism
    custom           the one way an op here becomes a torch custom op
    backend          whether the Triton kernels are here
    side_by_side     CPU runtime: expert segments side by side on single-threaded workers
    gradient_memory  CPU runtime: the stacked weight gradients' memory, kept between backwards
"""

"""The Triton kernels and their launchers: the lowest tier of `moespec.layers`, and the only one that imports
Triton. Importing this package raises ImportError where Triton is not installed; `ops/backend.py` is the one
place that imports it, and says whether the kernels are there.

    common     the helpers every kernel shares: activations, the fp32 dot, the row-block raster over segments
    scattered  the scattered expert FFN of the forced triton step (fc1 / fc2 with gathers and scatters, backward)
    pairs      routing and the combine: softmax + top-k, the pairs sorted by expert, the gather-sum
    bias_act   fc1's bias and the activation in one pass (the grouped step)
"""

import triton  # noqa: F401  (ImportError here where Triton is not installed)

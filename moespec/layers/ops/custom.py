"""The one way moespec registers a torch custom op: opaque to torch.compile (one op in the graph, static shapes),
with a fake function for its output shapes and, where given, its autograd formula."""

from __future__ import annotations

from typing import Callable

import torch


def custom_op(name: str, fn: Callable, *, fake: Callable, backward: Callable | None = None,
              setup: Callable | None = None) -> Callable:
    """`fn` as the custom op `moespec::name` with its fake function (and `backward`, `setup` as torch's
    `register_autograd` takes them); `fn` itself where this torch has no custom ops (< 2.4), whose autograd then
    records fn's own torch ops."""
    if not hasattr(torch.library, "custom_op"):
        return fn
    op = torch.library.custom_op(f"moespec::{name}", mutates_args=())(fn)
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup)
    return op

"""Memory for the experts' stacked weight gradients on CPU, kept from one backward to the next.

The gradient of a stacked expert weight is E times a dense layer's. glibc's malloc maps every block above 32 MB
fresh at each allocation and unmaps it when it is freed, so each backward took the first touch of every page again
(docs/dispatch.md, "Figures behind the code"). torch has no caching allocator on CPU; the GPU's
caching allocator keeps such memory already, so only CPU parameters use this.

Each parameter gets at most two blocks of its own: one for the gradient that AccumulateGrad adopts as `.grad`,
one for a backward that accumulates into an existing `.grad`. A block is lent as a fresh memoryview wrapped by
`torch.frombuffer`; the tensor's storage holds the only reference to that view, so the view dies exactly when the
last tensor, view or storage on that memory does, and a weak reference to it says when the block is free again.
Where both blocks are still in use (a caller keeping old gradients), the gradient comes from torch's allocator
as before. The blocks go with their parameter. They are private anonymous memory: a process forked after a
backward (a DataLoader worker, Hogwild training) gets its own copy on write, never the parent's pages.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

SMALLEST = 1 << 20  # bytes; below this malloc's heap serves gradients again and again without page faults
BLOCKS_PER_PARAMETER = 2

_blocks: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> [(block, weak ref to its lent view)]
_lock = threading.Lock()  # backward can run on several threads


def empty_gradient(param: torch.Tensor, *, traced: bool) -> torch.Tensor:
    """An uninitialized contiguous tensor of param's shape, dtype and device, for param's gradient: on one of
    param's kept blocks where it is a CPU `nn.Parameter` of at least `SMALLEST` bytes and torch is not compiling
    (`traced`: torch.compile or torch.export traces the call, `Mode.traced`)."""
    nbytes = param.numel() * param.element_size()
    kept = type(param) is nn.Parameter and param.device.type == "cpu" and nbytes >= max(SMALLEST, 1)
    if not kept or traced:
        return torch.empty(param.shape, dtype=param.dtype, device=param.device)
    with _lock:  # blocks in use, and free ones of the right size (a dtype change leaves the others behind)
        blocks = [(block, lent) for block, lent in _blocks.get(param, ()) if lent() is not None or len(block) == nbytes]
        free = next((block for block, lent in blocks if lent() is None), None)
        if free is None and len(blocks) < BLOCKS_PER_PARAMETER:
            free = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # private: a fork copies it on write
        if free is not None:
            view = memoryview(free)
            blocks = [(block, lent) for block, lent in blocks if block is not free] + [(free, weakref.ref(view))]
        _blocks[param] = blocks
    if free is None:  # every block in use: torch's own memory
        return torch.empty(param.shape, dtype=param.dtype)
    return torch.frombuffer(view, dtype=param.dtype).view(param.shape)


def release() -> None:
    """Give back every kept block no tensor uses (after training, say); the next backward keeps memory again."""
    with _lock:
        for param, blocks in list(_blocks.items()):
            _blocks[param] = [(block, lent) for block, lent in blocks if lent() is not None]

"""Expert segments side by side on a busy CPU: each segment's small ops on one thread, the segments shared out
between threads, one wait per layer.

torch runs every CPU op with all its intra-op threads, which meet at a barrier when the op ends. On an idle
machine a barrier costs microseconds. On a busy one (a laptop, a shared box, CI) the scheduler takes a thread
away for a time slice of milliseconds, and the other threads wait at the barrier for it: every op costs at
least a slice. A dense FFN is three large ops and barely notices. An MoE layer run expert by expert is a few
small ops per expert, and each of them pays the slice (docs/dispatch.md, "On a busy CPU").

So where the experts' segments are many and the caller has threads to spare, `each` runs the segments on a
pool of as many workers as the caller has intra-op threads. Every worker runs torch single-threaded and takes
the next segment when it is done with one (largest first), so a worker the scheduler pauses delays only the
segment it holds, and the caller waits once for them all. Each segment computes on one thread wherever it
runs, so its result does not depend on which worker took it: runs stay bit-reproducible.

The workers take the caller's grad mode, inference mode and CPU autocast. Anything else that lives per thread
(a torch function or dispatch mode, a functorch transform, saved-tensor hooks, the profiler, anomaly mode,
a trace) runs the segments here in order.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from typing import Callable, Iterable, Sequence, TypeVar

import torch

from .mode import traced

T = TypeVar("T")

MIN_WORK = 1 << 18  # elements; below, the workers' Python (which holds the GIL) would cost more than the ops


def each(fn: Callable[[T], None], tasks: Sequence[T], work: Sequence[int], *, device: torch.device) -> None:
    """fn(task) for every task: side by side on the pool where that helps, else here in order. It helps on a CPU
    `device`, with two tasks or more, `MIN_WORK` in all, two torch threads or more on this thread, and no
    per-thread state the workers cannot take on (see the module). `work` (one figure per task: the elements it
    computes, say rows x width) orders the tasks largest first. fn writes its results into memory that no other
    task writes; its first exception is raised here, after every task has ended."""
    threads = torch.get_num_threads()
    if (device.type != "cpu" or len(tasks) < 2 or threads < 2 or sum(work) < MIN_WORK
            or not _plain_state()):
        for task in tasks:
            fn(task)
        return
    order = sorted(range(len(tasks)), key=work.__getitem__, reverse=True)
    _pool(threads).run(fn, [tasks[i] for i in order])


def each_segment(fn: Callable[[int, slice], None], segments: Iterable[tuple[int, slice]], width: int, *,
                 device: torch.device) -> None:
    """`each` over expert segments: fn(e, rows) for every (expert, row slice), `width` elements of work per row."""
    segments = list(segments)
    each(lambda segment: fn(*segment), segments, [(rows.stop - rows.start) * width for _, rows in segments],
         device=device)


def _plain_state() -> bool:
    """Whether this thread's torch state is one the workers can take on (`_Pool._state`): no trace, no torch
    function or dispatch mode, no functorch transform, no saved-tensor hooks (activation checkpointing,
    offloading), no profiler, no anomaly mode."""
    return not (torch.jit.is_tracing() or traced() or torch.is_anomaly_enabled()
                or torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack()
                or torch._C._functorch.peek_interpreter_stack() is not None
                or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
                or torch.autograd._profiler_enabled())


class _Pool:
    """`size` daemon threads, each running torch on one intra-op thread, taking tasks from one queue."""

    def __init__(self, size: int):
        self.size, self.pid = size, os.getpid()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        started = threading.Barrier(size + 1)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a new thread takes torch's thread count from here on its first parallel op...
        try:
            for _ in range(size):
                threading.Thread(target=self._work, args=(started,), daemon=True, name="moespec-expert").start()
            started.wait()
        finally:
            torch.set_num_threads(threads)  # ...so the workers keep 1, and the caller and later threads get theirs

    def _work(self, started: threading.Barrier) -> None:
        torch.set_num_threads(1)
        torch.zeros(1 << 16).add_(1)  # the first parallel op, while the count is 1: this thread keeps 1
        started.wait()
        while True:
            batch = self.jobs.get()
            batch.work()
            del batch  # what the tasks hold (gradients, graphs) is the caller's to free

    def run(self, fn, tasks: list) -> None:
        batch = _Batch(fn, tasks, self._state())
        for _ in range(min(self.size, len(tasks))):
            self.jobs.put(batch)
        batch.done.wait()
        error = batch.release()
        if error is not None:
            raise error

    @staticmethod
    def _state():
        """The caller's per-thread torch state that the workers take on."""
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        autocast = torch.is_autocast_enabled("cpu")
        dtype = torch.get_autocast_dtype("cpu") if autocast else None

        @contextlib.contextmanager
        def state():
            with contextlib.ExitStack() as stack:
                if inference:
                    stack.enter_context(torch.inference_mode())
                stack.enter_context(torch.set_grad_enabled(grad))
                if autocast:
                    stack.enter_context(torch.autocast("cpu", dtype=dtype))
                yield
        return state


class _Batch:
    """One `each` call's tasks: workers take the next until none is left; the last to finish signals `done`.
    A copy of it may wait in the queue after the call returned, so `release` lets go of the tasks."""

    def __init__(self, fn, tasks: list, state):
        self.fn, self.tasks, self.state = fn, tasks, state
        self.next, self.left, self.error = 0, len(tasks), None
        self.lock, self.done = threading.Lock(), threading.Event()

    def work(self) -> None:
        with self.state():
            while True:
                with self.lock:
                    if self.tasks is None or self.next == len(self.tasks):
                        return
                    fn, task, self.next = self.fn, self.tasks[self.next], self.next + 1
                try:
                    if self.error is None:
                        fn(task)
                except BaseException as error:  # noqa: BLE001 - raised in the caller
                    self.error = self.error or error
                finally:
                    del task
                    with self.lock:
                        self.left -= 1
                        if not self.left:
                            self.done.set()

    def release(self) -> BaseException | None:
        with self.lock:
            self.fn = self.tasks = None
        error, self.error = self.error, None
        return error


_pools: dict[int, _Pool] = {}
_pools_lock = threading.Lock()


def _pool(size: int) -> _Pool:
    """The process's pool of `size` workers (made again in a forked child, which has none of the threads)."""
    with _pools_lock:
        pool = _pools.get(size)
        if pool is None or pool.pid != os.getpid():
            pool = _pools[size] = _Pool(size)
        return pool

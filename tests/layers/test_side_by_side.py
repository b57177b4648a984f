"""`side_by_side.each`: expert segments on a pool of single-threaded workers, one wait per call.

What it must keep: the caller's results bit for bit (each task computes on one thread wherever it runs), the
caller's and later threads' torch thread counts, the caller's grad mode, inference mode and autocast, errors, and
no reference to what the tasks held once the call returns. Whether it is faster on a busy CPU is a benchmark's
question (`tools/bench_moe.py --load N`), not a test's.
"""

from __future__ import annotations

import gc
import multiprocessing
import threading
import time
import weakref

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from moespec.layers import Experts, LinearGate, MoE, TopKRouter, set_expert_step
from moespec.layers.ops import side_by_side
from moespec.layers.ops.side_by_side import each

CPU = torch.device("cpu")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _where(tasks=4, work=side_by_side.MIN_WORK):
    seen = {}

    def task(i):
        seen[i] = (threading.current_thread().name, torch.get_num_threads(), torch.is_grad_enabled(),
                   torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"))

    each(task, list(range(tasks)), [work] * tasks, device=CPU)
    return seen


def test_the_workers_run_torch_on_one_thread_and_leave_every_other_threads_count_alone(two_threads):
    seen = _where()
    assert sorted(seen) == [0, 1, 2, 3]
    assert {name for name, *_ in seen.values()} <= {"moespec-expert"}
    assert {threads for _, threads, *_ in seen.values()} == {1}
    assert torch.get_num_threads() == 2
    later = []
    thread = threading.Thread(target=lambda: (torch.ones(1 << 16).add_(1), later.append(torch.get_num_threads())))
    thread.start()
    thread.join()
    assert later == [2]  # a thread started after the pool takes torch's count as the caller set it


def test_the_workers_take_the_callers_grad_mode_inference_mode_and_autocast(two_threads):
    with torch.no_grad():
        assert {s[2:] for s in _where().values()} == {(False, False, False)}
    with torch.inference_mode():
        assert {s[3] for s in _where().values()} == {True}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert {s[2:] for s in _where().values()} == {(True, False, True)}


def test_small_work_one_thread_or_per_thread_state_runs_here_in_order(two_threads):
    here = threading.current_thread().name
    assert {s[0] for s in _where(work=1).values()} == {here}  # below MIN_WORK in all
    assert {s[0] for s in _where(tasks=1).values()} == {here}

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert {s[0] for s in _where().values()} == {here}
    with torch.autograd.graph.save_on_cpu():
        assert {s[0] for s in _where().values()} == {here}
    torch.set_num_threads(1)
    assert {s[0] for s in _where().values()} == {here}


def test_a_tasks_error_is_raised_here_after_every_task_ended(two_threads):
    ended = []

    def task(i):
        time.sleep(0.01)
        if i == 1:
            raise ValueError("task 1")
        ended.append(i)

    with pytest.raises(ValueError, match="task 1"):
        each(task, [0, 1, 2, 3], [side_by_side.MIN_WORK] * 4, device=CPU)
    at_return = list(ended)
    time.sleep(0.1)
    assert ended == at_return  # no task still ran once the call returned
    assert _where()  # and the pool still works


def test_nothing_the_tasks_held_outlives_the_call(two_threads):
    held = torch.ones(1000)

    def task(i):  # what a layer's task holds: gradients, graphs
        held.add_(0)

    alive = weakref.ref(task)
    each(task, [0, 1, 2, 3], [side_by_side.MIN_WORK] * 4, device=CPU)
    del task
    gc.collect()
    assert alive() is None


def _layer(seed=0):
    torch.manual_seed(seed)
    bank = Experts(8, 16, 32, 16, act=nn.GELU())
    return MoE(TopKRouter(LinearGate(16, 8), 8, 2), bank)


@pytest.mark.parametrize("step", ["loop", "grouped_mm", "padded"])
def test_a_layer_gives_the_same_bits_side_by_side_as_in_order(step, two_threads, monkeypatch):
    """Tiny shapes, so that every op runs on one thread in order too: the bits must then be equal."""
    x = torch.randn(4, 50, 16)

    def run(min_work):
        monkeypatch.setattr(side_by_side, "MIN_WORK", min_work)
        layer = set_expert_step(_layer(), step)
        with torch.no_grad():
            eval_out = layer(x)
        xs = x.clone().requires_grad_()
        out = layer(xs)
        out.square().sum().backward()
        return [eval_out, out, xs.grad, *(p.grad for p in layer.parameters())]

    in_order, pooled = run(1 << 62), run(0)
    for a, b in zip(in_order, pooled, strict=True):
        assert torch.equal(a, b)


def _forked_child(queue):
    done = []  # no torch op here: GNU OpenMP itself hangs in a forked child that runs a parallel op
    side_by_side._pool(2).run(lambda i: done.append((i, threading.current_thread().name)), [0, 1, 2])
    queue.put(sorted(done))


def test_a_forked_child_gets_a_pool_of_its_own(two_threads):
    assert _where()  # the parent's pool exists before the fork; its threads do not exist in the child
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_forked_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung")
    assert child.exitcode == 0 and queue.get(timeout=5) == [(i, "moespec-expert") for i in range(3)]

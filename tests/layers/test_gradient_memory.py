"""The experts' weight gradients on CPU come from memory kept per parameter (`gradient_memory`): the same bits
as fresh memory, never memory a live tensor still uses, at most two blocks per parameter, gone with it."""

from __future__ import annotations

import copy
import gc
import io
import os
import signal
import time

import pytest
import torch
from torch import nn

from moespec.layers import Experts, LinearGate, MoE, SoftMoE, TopKRouter, set_expert_step
from moespec.layers.ops import gradient_memory
from moespec.layers.steps import available_steps


@pytest.fixture
def kept(monkeypatch):
    """Keep memory for every gradient, however small (the tiny banks here are below the real threshold)."""
    monkeypatch.setattr(gradient_memory, "SMALLEST", 0)


def _moe(dispatch: str, structure: dict | None = None) -> MoE:
    torch.manual_seed(0)
    bank = Experts(4, 8, 16, 8, **{"act": nn.GELU(), **(structure or {})})
    set_expert_step(bank, dispatch)
    return MoE(TopKRouter(LinearGate(8, 4), 4, 2), bank)


def _steps(model: nn.Module, set_to_none: bool, steps: int = 3) -> list[list[torch.Tensor]]:
    """Every parameter gradient after each of `steps` backwards; the gradients add up when not set to None."""
    torch.manual_seed(1)
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=set_to_none) if set_to_none else None
        model(torch.randn(2, 9, 8)).square().sum().backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def _kept_params() -> int:
    return sum(len(blocks) for blocks in gradient_memory._blocks.values())


@pytest.mark.parametrize("dispatch", available_steps())
@pytest.mark.parametrize("structure", [{}, {"glu": "act_first", "act": nn.SiLU()}, {"inner_norm": "layernorm"}],
                         ids=["plain", "swiglu", "layernorm"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_on_kept_memory_are_the_bits_of_fresh_memory(monkeypatch, dispatch, structure, set_to_none):
    fresh = _steps(_moe(dispatch, structure), set_to_none)
    monkeypatch.setattr(gradient_memory, "SMALLEST", 0)
    model = _moe(dispatch, structure)
    before = _kept_params()
    kept = _steps(model, set_to_none)
    assert _kept_params() > before
    for step_fresh, step_kept in zip(fresh, kept, strict=True):
        for a, b in zip(step_fresh, step_kept, strict=True):
            assert torch.equal(a, b)


def test_soft_moe_weight_gradients_use_kept_memory_with_the_same_bits(monkeypatch):
    def soft():
        torch.manual_seed(0)
        return SoftMoE(Experts(4, 8, 16, 8, act=nn.GELU()), slots_per_expert=2)

    fresh = _steps(soft(), set_to_none=True)
    monkeypatch.setattr(gradient_memory, "SMALLEST", 0)
    model = soft()
    kept = _steps(model, set_to_none=True)
    assert model.experts.fc1.weight in gradient_memory._blocks
    for a, b in zip(fresh[-1], kept[-1], strict=True):
        assert torch.equal(a, b)


def test_a_block_is_lent_again_only_when_no_tensor_uses_it(kept):
    model = _moe("loop")
    weight = model.experts.fc1.weight

    def step():  # new inputs each time: memory lent twice would show as changed values
        model.zero_grad(set_to_none=True)
        model(torch.randn(2, 9, 8)).square().sum().backward()
        return weight.grad, weight.grad.clone()

    first, first_values = step()
    row, blocks = first[1], {first.data_ptr()}  # a view keeps the memory in use after the gradient is gone
    del first
    second, second_values = step()
    blocks.add(second.data_ptr())
    third, third_values = step()  # both blocks in use: torch's own memory, no third block
    assert len(blocks) == 2 and third.data_ptr() not in blocks and len(gradient_memory._blocks[weight]) == 2
    assert torch.equal(row, first_values[1]) and torch.equal(second, second_values)
    assert torch.equal(third, third_values) and not torch.equal(second, third)
    del row, second, third
    assert {step()[0].data_ptr() for _ in range(3)} <= blocks  # free again, lent again


def test_the_blocks_go_with_their_parameter(kept):
    model = _moe("loop")
    _steps(model, set_to_none=True)
    kept_for = {id(p) for p in model.parameters() if p in gradient_memory._blocks}
    assert id(model.experts.fc1.weight) in kept_for
    del model
    gc.collect()
    assert not kept_for & {id(p) for p in gradient_memory._blocks.keys()}


def test_a_model_with_gradients_on_kept_memory_copies_saves_shares_and_changes_dtype(kept):
    model = _moe("padded")
    model(torch.randn(2, 9, 8)).sum().backward()
    grad = model.experts.fc1.weight.grad.clone()
    copy.deepcopy(model)
    torch.save(model, io.BytesIO())
    model.share_memory()  # moves every parameter and gradient into shared memory
    assert model.experts.fc1.weight.grad.is_shared() and torch.equal(model.experts.fc1.weight.grad, grad)
    model.double()  # the same parameters in a new dtype: blocks of the old size are not lent
    model.zero_grad(set_to_none=True)
    model(torch.randn(2, 9, 8, dtype=torch.float64)).sum().backward()
    assert model.experts.fc1.weight.grad.dtype == torch.float64
    assert all(len(block) == model.experts.fc1.weight.numel() * 8
               for block, _ in gradient_memory._blocks[model.experts.fc1.weight])


def test_only_cpu_parameters_outside_compilation_use_kept_memory(kept):
    plain = torch.zeros(4, 4)
    assert gradient_memory.empty_gradient(plain, traced=False).shape == (4, 4)
    assert plain not in gradient_memory._blocks
    on_meta = nn.Parameter(torch.zeros(4, 4, device="meta"))
    assert gradient_memory.empty_gradient(on_meta, traced=False).device.type == "meta"
    assert on_meta not in gradient_memory._blocks


def test_release_gives_back_the_blocks_no_tensor_uses(kept):
    model = _moe("loop")
    _steps(model, set_to_none=False)  # the gradient on one block, the accumulation on the other
    weight = model.experts.fc1.weight
    assert len(gradient_memory._blocks[weight]) == 2
    gradient_memory.release()
    assert [lent() is not None for _, lent in gradient_memory._blocks[weight]] == [True]  # .grad's block
    model.zero_grad(set_to_none=True)
    gradient_memory.release()
    assert gradient_memory._blocks[weight] == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_process_writes_its_own_copy_of_the_blocks(kept):
    """A process forked after a backward (a DataLoader worker, Hogwild training) that runs backwards of its own
    lends the blocks it inherited: they must be its private copy, not the parent's pages."""
    if torch.cuda.is_available():
        pytest.skip("with a GPU present, the parent's first backward starts autograd's device threads, and a "
                    "backward in a forked child then raises (PyTorch's autograd-and-fork limitation; use spawn)")
    model = _moe("loop")
    model(torch.randn(2, 9, 8)).square().sum().backward()
    weight = model.experts.fc1.weight
    held, expected = weight.grad, weight.grad.clone()  # the parent keeps its gradient, on a kept block
    block = held.data_ptr()
    pid = os.fork()
    if pid == 0:  # child: free the inherited block, write new gradients onto it, leave without pytest's cleanup
        code = 1
        try:
            torch.set_num_threads(1)  # as a DataLoader worker: the parent's thread pool does not survive a fork
            del held
            model.zero_grad(set_to_none=True)
            model(torch.full((2, 9, 8), 3.0)).square().sum().backward()
            code = 0 if weight.grad.data_ptr() == block else 3  # 3: the child did not reuse the block
        finally:
            os._exit(code)
    deadline = time.monotonic() + 600  # a hang guard: far above the work, so a busy machine never trips it
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked process did not finish in 600 s")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert held is weight.grad and torch.equal(held, expected)

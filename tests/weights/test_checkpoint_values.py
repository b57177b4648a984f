"""Checkpoint values that load into a model that then misbehaves silently (issue 47): a non-finite balancing
bias (NaN, or 1e300 that becomes inf in float32) or a NaN buffer is refused at load, naming the tensor;
`update_bias` never writes a non-finite bias; a pooling the model does not take is one CheckpointError."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import moespec
from moespec.errors import CheckpointError, MoespecError
from moespec.weights.checkpoint import POOL_KEY

TINY = {"model": "vit_small_patch16_224",
        "kwargs": {"depth": 2, "img_size": 32, "embed_dim": 32, "num_heads": 2, "num_classes": 10}}
BALANCED = [{"where": {"every": 1}, "experts": 4, "router": {"kind": "topk", "top_k": 1, "bias_balance": {}}}]
BIAS = "blocks.0.mlp.router.balance.expert_bias"


def _model(seed: int = 0):
    return moespec.create_model(moespec.load_spec({"name": "t", "backbone": TINY, "input_size": [3, 32, 32],
                                                   "moe": BALANCED}), seed=seed)


def _saved(tmp_path, change=None, metadata=None):
    model = _model()
    path = moespec.save(model, tmp_path / "model.safetensors")
    if change or metadata:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            header = f.metadata()
        state = load_file(str(path))
        if change:
            change(state)
        save_file(state, str(path), metadata={**header, **(metadata or {})})
    return path


def test_the_bias_is_named_in_the_state_dict():
    model = _model()
    assert BIAS in model.state_dict()


@pytest.mark.parametrize("value, dtype, shown", [(float("nan"), torch.float32, "nan"),
                                                 (1e300, torch.float64, "inf"),
                                                 (float("-inf"), torch.float32, "-inf")])
def test_a_non_finite_balancing_bias_is_refused_at_load(tmp_path, value, dtype, shown):
    """A checkpoint whose expert_bias was NaN (or 1e300, inf in float32) loaded; training then sent every token
    to the same experts."""
    def poison(state):
        state[BIAS] = state[BIAS].to(dtype)
        state[BIAS][1] = value

    path = _saved(tmp_path, poison)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: {re.escape(BIAS)} holds {shown} "):
        moespec.load(path)


def test_a_finite_bias_loads_as_it_was_saved(tmp_path):
    path = _saved(tmp_path, lambda state: state[BIAS].fill_(0.25))
    assert torch.equal(moespec.load(path).state_dict()[BIAS], torch.full((4,), 0.25))


def test_update_bias_never_writes_a_non_finite_bias():
    model = _model()
    bias = model.get_buffer(BIAS)
    bias[2] = float("nan")
    model.train()
    model(torch.randn(2, 3, 32, 32))
    with pytest.raises(MoespecError, match=r"^blocks\.0\.mlp: the balancing bias would hold nan; update_bias writes "
                                           r"only finite biases"):
        moespec.update_bias(model)
    assert bias.isnan().sum() == 1  # left as it was
    bias.fill_(float("inf"))
    model(torch.randn(2, 3, 32, 32))
    with pytest.raises(MoespecError, match="would hold inf"):
        moespec.update_bias(model)


@pytest.mark.parametrize("pool", ["no-such-pool", "x" * 10_000])
def test_a_pooling_the_model_does_not_take_is_one_checkpoint_error(tmp_path, pool):
    """A checkpoint with a bad moespec.global_pool was an internal error."""
    path = _saved(tmp_path, metadata={POOL_KEY: pool})
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: its {POOL_KEY} '.{{1,64}}' is not a pooling "
                                              r"this model takes"):
        moespec.load(path)

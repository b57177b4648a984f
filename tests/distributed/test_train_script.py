"""tools/train.py under torchrun on 2 gloo ranks: it trains, logs, saves the training state and the one-process
model file, and resumes from that state where it stopped."""

from __future__ import annotations

import importlib.util
import re

import pytest

import moespec

from .launch import ROOT, torchrun

SCRIPT = ROOT / "tools" / "train.py"
SPEC = ROOT / "tests" / "data" / "ep_tiny.yaml"


@pytest.mark.slow
def test_train_saves_and_resumes_on_two_ranks(tmp_path):
    run = ["--batch-size", "4", "--synthetic-size", "32", "--log-every", "1", "--warmup-steps", "1",
           "--clip-grad", "1.0", "--output", tmp_path]
    first = torchrun(2, SCRIPT, SPEC, "--steps", "4", "--save-every", "2", *run, timeout=120).stdout
    assert [int(s) for s in re.findall(r"^step (\d+)/4 ", first, re.M)] == [1, 2, 3, 4], first
    assert "done: step 4/4" in first and "img/s" in first, first
    assert (tmp_path / "state").is_dir()
    model = moespec.load(tmp_path / "model.safetensors")  # the one-process format: every expert in one file
    assert [layer.experts.num_experts for layer in moespec.moe_layers(model).values()] == [4, 4]

    second = torchrun(2, SCRIPT, SPEC, "--steps", "6", "--resume", tmp_path, *run, timeout=120).stdout
    assert "steps 4 -> 6 (resumed" in second, second
    assert [int(s) for s in re.findall(r"^step (\d+)/6 ", second, re.M)] == [5, 6], second


def test_expert_weight_decay_reaches_the_optimizer():
    """--expert-weight-decay: the routed experts' weights decay at it, everything else as timm groups it."""
    loaded = importlib.util.spec_from_file_location("moespec_train_tool", SCRIPT)
    train = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(train)
    model = moespec.create_model(moespec.load_spec(SPEC))
    names = {id(p): n for n, p in model.named_parameters()}
    for extra, expert_decay in (([], 0.05), (["--expert-weight-decay", "0.3"], 0.3)):
        args = train.parse_args([str(SPEC), "--weight-decay", "0.05", *extra])
        decay = {names[id(p)]: g["weight_decay"] for g in train.build_optimizer(model, args).param_groups
                 for p in g["params"]}
        assert {decay[n] for n in decay if ".experts.fc" in n and n.endswith(".weight")} == {expert_decay}
        assert {decay[n] for n in decay if ".experts." not in n and n.endswith(".weight") and "norm" not in n} \
            == {0.05}

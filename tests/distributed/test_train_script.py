"""tools/train.py under torchrun on 2 gloo ranks: it trains, logs, saves the training state and the one-process
model file, and resumes from that state where it stopped; on a (dp, ep) mesh under FSDP2 it trains the same
model; its mesh options are checked before anything runs."""

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


def losses(stdout: str) -> list[float]:
    return [float(loss) for loss in re.findall(r"^step \d+/\d+  loss (\S+) ", stdout, re.M)]


@pytest.mark.slow
def test_fsdp_over_a_dp_mesh_trains_what_the_default_layout_trains(tmp_path):
    """--ep 1 --data-parallel fsdp (every expert on both ranks, FSDP2 over the two): the losses of the default
    layout (experts split over the ranks, DDP), and a saved model that loads in one process."""
    run = [SPEC, "--steps", "3", "--batch-size", "4", "--synthetic-size", "32", "--log-every", "1",
           "--clip-grad", "1.0"]
    default = torchrun(2, SCRIPT, *run, timeout=120).stdout
    fsdp = torchrun(2, SCRIPT, *run, "--ep", "1", "--data-parallel", "fsdp", "--output", tmp_path, timeout=120).stdout
    assert "2 rank(s) on cpu, dp 1 x ep 2, ddp" in default, default
    assert "2 rank(s) on cpu, dp 2 x ep 1, fsdp" in fsdp, fsdp
    assert len(losses(fsdp)) == 3 and losses(fsdp) == pytest.approx(losses(default), abs=2e-4), (default, fsdp)
    model = moespec.load(tmp_path / "model.safetensors")
    assert [layer.experts.num_experts for layer in moespec.moe_layers(model).values()] == [4, 4]


def load_train_tool():
    loaded = importlib.util.spec_from_file_location("moespec_train_tool", SCRIPT)
    train = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(train)
    return train


@pytest.mark.parametrize(("world", "options", "message"), [
    (None, ["--ep", "2"], "run the script under torchrun"),
    (None, ["--data-parallel", "fsdp"], "run the script under torchrun"),
    ("4", ["--ep", "3"], "--ep 3 must divide the number of ranks, 4 (dp = ranks / ep): one of 1, 2, 4"),
    ("4", ["--ep", "0"], "--ep 0 must divide"),
    ("4", ["--data-parallel", "zero"], "invalid choice: 'zero'"),
])
def test_mesh_options_are_checked(monkeypatch, capsys, world, options, message):
    train = load_train_tool()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as exit_:
        train.parse_args([str(SPEC), *options])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_expert_weight_decay_reaches_the_optimizer():
    """--expert-weight-decay: the routed experts' weights decay at it, everything else as timm groups it."""
    train = load_train_tool()
    model = moespec.create_model(moespec.load_spec(SPEC))
    names = {id(p): n for n, p in model.named_parameters()}
    for extra, expert_decay in (([], 0.05), (["--expert-weight-decay", "0.3"], 0.3)):
        args = train.parse_args([str(SPEC), "--weight-decay", "0.05", *extra])
        decay = {names[id(p)]: g["weight_decay"] for g in train.build_optimizer(model, args).param_groups
                 for p in g["params"]}
        assert {decay[n] for n in decay if ".experts.fc" in n and n.endswith(".weight")} == {expert_decay}
        assert {decay[n] for n in decay if ".experts." not in n and n.endswith(".weight") and "norm" not in n} \
            == {0.05}

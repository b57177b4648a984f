"""transformers builds a moespec Hub folder (issue 63, point 4): once moespec is imported, in any order with
transformers and timm, `AutoModelForImageClassification.from_pretrained(FOLDER)` and `TimmWrapperModel` build the
MoE model through timm from what `moespec.save_for_hf` writes, with its MoE layers and the saving model's
outputs. transformers is a test extra: without it these tests skip."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import moespec

from ..conftest import randomize
from .test_hub_roundtrip import CONVNEXT, LABELS, VIT

transformers = pytest.importorskip("transformers")

# with buffers that transformers' meta build must not lose: a balancing bias and its counts
BALANCED_CONVNEXT = {**CONVNEXT, "moe": [{"where": {"last": 2}, "experts": 2,
                                          "router": {"kind": "topk", "top_k": 1, "bias_balance": {"rate": 0.01}}}]}


def _saved(document: dict, folder) -> tuple[torch.nn.Module, torch.Tensor]:
    """A moespec model with weights (and balancing biases) unlike a fresh build, saved to `folder`, and an input."""
    model = randomize(moespec.create_model(moespec.load_spec(document), seed=0), seed=1).eval()
    for layer in moespec.moe_layers(model).values():
        balance = getattr(layer.router, "balance", None)
        if balance is not None:
            balance.expert_bias.copy_(torch.linspace(-0.5, 0.5, balance.expert_bias.numel()))
    moespec.save_for_hf(model, folder, model_config={"label_names": LABELS})
    return model, torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("document", [VIT, BALANCED_CONVNEXT], ids=["vit", "convnext"])
def test_transformers_builds_the_moe_model_with_the_saved_outputs(tmp_path, document):
    from transformers import AutoModelForImageClassification, TimmWrapperModel

    model, x = _saved(document, tmp_path / "hub")
    classifier = AutoModelForImageClassification.from_pretrained(tmp_path / "hub").eval()
    backbone = TimmWrapperModel.from_pretrained(tmp_path / "hub").eval()
    for wrapper in (classifier, backbone):
        assert type(wrapper.timm_model) is type(model)
        assert list(moespec.moe_layers(wrapper.timm_model)) == list(moespec.moe_layers(model))
    assert classifier.config.id2label == dict(enumerate(LABELS)) and backbone.timm_model.num_classes == 0
    with torch.no_grad():
        torch.testing.assert_close(classifier(x).logits, model(x), rtol=0, atol=0)
        pooled = model.forward_head(model.forward_features(x), pre_logits=True)
        torch.testing.assert_close(backbone(x).pooler_output, pooled, rtol=0, atol=0)
    for (name, buffer), (_, saved) in zip(classifier.timm_model.named_buffers(), model.named_buffers(), strict=True):
        assert not buffer.is_meta and torch.equal(buffer, saved), name

    classifier.train()  # transformers' Trainer fine-tunes it: the aux loss reaches the gradients (hub.py)
    classifier(x).logits.sum().backward()
    assert all(p.grad is not None for p in classifier.timm_model.parameters() if p.requires_grad)


def test_a_new_label_count_fine_tunes_from_the_folder(tmp_path):
    """`num_labels` other than the saved head: transformers' own rule, a new head and every other weight read."""
    from transformers import AutoModelForImageClassification

    model, _ = _saved(VIT, tmp_path / "hub")
    tuned = AutoModelForImageClassification.from_pretrained(tmp_path / "hub", num_labels=3,
                                                            ignore_mismatched_sizes=True)
    assert tuned.timm_model.num_classes == 3 and tuned.timm_model.head.out_features == 3
    experts = tuned.timm_model.blocks[1].mlp.experts
    torch.testing.assert_close(experts.fc1.weight, model.blocks[1].mlp.experts.fc1.weight)


BUILD = """
import json, sys, torch
from transformers import AutoModelForImageClassification, TimmWrapperModel
import moespec
x = torch.load(sys.argv[2])
found = {}
for cls in (AutoModelForImageClassification, TimmWrapperModel):
    wrapper = cls.from_pretrained(sys.argv[1]).eval()
    with torch.no_grad():
        out = wrapper(x)
    found[cls.__name__] = [type(wrapper.timm_model).__name__, len(moespec.moe_layers(wrapper.timm_model)),
                           (out.logits if hasattr(out, "logits") else out.pooler_output).tolist()]
print("FOUND", json.dumps(found))
"""
ORDERS = {"moespec-transformers-timm": "import moespec, transformers, timm",
          "transformers-moespec": "import transformers, moespec",
          "timm-transformers-moespec": "import timm, transformers, moespec",
          "wrapper-moespec": "from transformers import TimmWrapperModel\nimport moespec"}  # timm via transformers


@pytest.mark.slow
def test_every_import_order_builds_the_moe_model(tmp_path):
    """Each order in a fresh interpreter (the first import of timm is what registers moespec's architecture),
    two at a time: both classes build the MoE model, and their outputs are the saving model's."""
    model, x = _saved(VIT, tmp_path / "hub")
    torch.save(x, tmp_path / "x.pt")
    with torch.no_grad():
        expected = {"AutoModelForImageClassification": model(x),
                    "TimmWrapperModel": model.forward_head(model.forward_features(x), pre_logits=True)}

    def run(first: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", first + BUILD, str(tmp_path / "hub"), str(tmp_path / "x.pt")],
                              capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        done = dict(zip(ORDERS, pool.map(run, ORDERS.values()), strict=True))
    for order, result in done.items():
        lines = [line for line in result.stdout.splitlines() if line.startswith("FOUND ")]
        assert lines, f"{order}: {result.stderr[-2000:]}"
        found = json.loads(lines[-1].removeprefix("FOUND "))
        for name, (kind, layers, out) in found.items():
            assert (kind, layers) == ("VisionTransformer", 2), (order, name)
            torch.testing.assert_close(torch.tensor(out), expected[name], rtol=0, atol=0, msg=f"{order}: {name}")

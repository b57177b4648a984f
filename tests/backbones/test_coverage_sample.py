"""The coverage probe (tools/coverage.py, behind docs/coverage.md) on a fixed sample of ten timm families, one
per composed FFN class: each plans, builds, runs, trains one step and upcycles to the dense model's logits with
the spec a new user writes (the last 2 blocks, 4 experts, normalized top-1, no `sublayer`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "coverage.py"

SAMPLE = {  # timm module -> the FFN class of its blocks
    "tiny_vit": "NormMlp",  # a LayerNorm before fc1, shared
    "swiftformer": "Mlp",  # a BatchNorm before fc1, shared
    "fastvit": "ConvMlp",  # a 7x7 depthwise conv before fc1, shared
    "levit": "LevitMlp",  # Linear + BatchNorm pairs, folded
    "repvit": "RepVitMlp",  # ConvNorm pairs, folded
    "efficientformer": "ConvMlpWithNorm",  # conv, BatchNorm, act, conv, BatchNorm
    "vitamin": "GeGluMlp",  # a GLU with its own LayerNorm
    "fasternet": "MLPBlock",  # a plain nn.Sequential FFN inside the block class named like an FFN
    "visformer": "SpatialMlp",  # 1x1 convs without the spatial conv
    "coat": "Mlp",  # the FFN under another name (mlp2)
}


def _coverage():
    spec = importlib.util.spec_from_file_location("moespec_coverage_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ten real timm models, each in a subprocess: about 3 minutes
@pytest.mark.parametrize("module", list(SAMPLE))
def test_a_family_of_each_ffn_class_plans_builds_trains_and_upcycles(module):
    row = _coverage().probe(module, timeout=300)
    assert row["status"] == "upcycle", row
    assert SAMPLE[module] in row["ffn_classes"] and row["blocks"] >= 2
    assert row["upcycle_diff"] <= 1e-5

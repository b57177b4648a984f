"""A pytest plugin that runs timm's own `tests/test_models.py` (vendored unchanged beside this file) on moespec
names: every timm test that runs on one of six dense backbones runs again on the registered MoE names built
from it, with timm's own parameters. `tests/test_timm_suite.py` runs it in a subprocess and compares each MoE
result with its dense twin's.

How: before timm's module is collected, eight specs are registered with `moespec.register_timm`. Each
`parametrize('model_name', ...)` of timm's is then rewritten: of its values, the six dense backbones are kept
(in timm's order), each followed by its MoE twins (the same other parameters, the MoE name in place of the
dense one); every other model, and every tag but timm's default one, is left out. A test whose models include
none of the six is deselected, as are those that download weights (no network here). A test listed in
NOT_APPLICABLE that fails on an MoE name with moespec's own refusal (for a TorchScript trace: after moespec's
warning) is reported as xfailed with the reason; any other failure stays a failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from timm.models import get_pretrained_cfg

import moespec
from moespec.errors import NotScriptableError
from moespec.layers.ops import mode

SPECS_DIR = Path(__file__).resolve().parents[2] / "specs"

TOP2 = {"where": {"every": 2}, "experts": 4, "router": {"kind": "topk", "top_k": 2}}
MOE_NAMES = {  # MoE name -> (dense backbone, moe groups); each name keeps its family's prefix for timm's filters
    "vit_small_patch16_224_moe_top2": ("vit_small_patch16_224", [TOP2]),
    "vit_small_patch16_224_moe_soft": (
        "vit_small_patch16_224", [{"where": {"last": 2}, "experts": 8, "router": {"kind": "soft"}}]),
    "vit_small_patch16_224_moe_image": (
        "vit_small_patch16_224",
        [{"where": {"last": 2}, "experts": 4, "router": {"kind": "image", "top_k": 1, "pool": "cls"}}]),
    "deit3_small_patch16_224_moe_capacity": (
        "deit3_small_patch16_224",
        [{**TOP2, "router": {"kind": "topk", "top_k": 2, "capacity_factor": 1.0}}]),
    "convnext_atto_moe": ("convnext_atto", [{"where": {"last": 2}, "experts": 4,
                                            "router": {"kind": "topk", "top_k": 1}}]),
    "swin_tiny_patch4_window7_224_moe": ("swin_tiny_patch4_window7_224", [TOP2]),
    "mixer_s16_224_sparse_mlp": ("mixer_s16_224", None),  # specs/sparse_mlp_s.yaml: rescale + MoE_S
    "eva02_tiny_patch14_224_moe": ("eva02_tiny_patch14_224", [TOP2]),  # EVA-02's SwiGLU (GluMlp) as experts
}
DENSE = {backbone for backbone, _ in MOE_NAMES.values()}
TWINS = {dense: [name for name, (backbone, _) in MOE_NAMES.items() if backbone == dense] for dense in DENSE}

# timm tests that need the network (pretrained weights or test images from the Hub): not run here
NETWORK = {"test_model_inference", "test_model_load_pretrained", "test_model_features_pretrained"}

# timm tests that cannot apply to an MoE, and why (docs/coverage.md lists them). On an MoE name each must fail
# with moespec's own refusal or warning, never with anything else; it is then reported as xfailed.
SCRIPT = ("torch.jit.script cannot compile data-dependent routing: moespec raises NotScriptableError, which "
          "names torch.export")
TRACE = ("a torch.jit.trace graph replays the example input's routing on every input: moespec warns once that it "
         "does, naming torch.export")
NOT_APPLICABLE = {
    "test_model_forward_torchscript": SCRIPT,
    "test_model_forward_fx_torchscript": SCRIPT,
    "test_swin_family_script_after_resize": SCRIPT,
    "test_swin_family_dynamic_mask_trace": TRACE,  # traced on one input, compared on another
}
WARNED = pytest.StashKey[bool]()


def _spec(name: str) -> moespec.Spec:
    backbone, groups = MOE_NAMES[name]
    if groups is None:
        document = yaml.safe_load((SPECS_DIR / "sparse_mlp_s.yaml").read_text())
    else:
        document = {"name": name.replace("_", "-"), "backbone": {"model": backbone}, "moe": groups}
    return moespec.load_spec(document)


def pytest_configure(config: pytest.Config) -> None:
    for name in MOE_NAMES:
        moespec.register_timm(_spec(name), name=name)


def _names(argnames) -> list[str]:
    return [n.strip() for n in argnames.split(",")] if isinstance(argnames, str) else list(argnames)


def _with_twins(argnames: list[str], values: list) -> tuple[list, list[str]]:
    """timm's values for one parametrize, cut to the dense backbones, each followed by its MoE twins; and their
    ids, as pytest makes them from timm's values (a value that is not a plain scalar is named by its place in
    timm's list, so that a dense case and its twins share the id but for the model)."""
    index, single = argnames.index("model_name"), len(argnames) == 1
    out, ids = [], []
    for position, value in enumerate(values):
        parameter_set = isinstance(value, type(pytest.param(None)))
        items = list(value.values) if parameter_set else [value] if single else list(value)
        base, _, tag = str(items[index]).partition(".")
        if base not in DENSE or tag and tag != get_pretrained_cfg(base).tag:  # a tagged name: timm's default
            continue
        for model in [items[index], *TWINS[base]]:
            swapped = [*items[:index], model, *items[index + 1:]]
            out.append(pytest.param(*swapped, marks=value.marks) if parameter_set
                       else swapped[0] if single else tuple(swapped))
            ids.append("-".join(str(item) if isinstance(item, (str, int, float, bool, type(None)))
                                else f"{argname}{position}" for argname, item in zip(argnames, swapped, strict=True)))
    return out, ids


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Rewrite timm's model_name parametrizations before pytest's own hook applies them."""
    markers = metafunc.definition.own_markers
    for position, mark in enumerate(markers):
        if mark.name != "parametrize":
            continue
        argnames, values = mark.args[0], mark.args[1]
        if "model_name" not in _names(argnames):
            continue
        kept, ids = _with_twins(_names(argnames), list(values))
        kwargs = {key: value for key, value in mark.kwargs.items() if key != "ids"}  # ids were for timm's values
        markers[position] = pytest.mark.parametrize(argnames, kept, ids=ids, **kwargs).mark


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, dropped = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        model = str(params.params.get("model_name")).partition(".")[0] if params else None
        on_ours = model in DENSE or model in MOE_NAMES
        (kept if on_ours and item.originalname not in NETWORK else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Note whether moespec gave its one TorchScript-trace warning during this test (it warns once a process)."""
    mode._warned_trace = False
    try:
        return (yield)
    finally:
        item.stash[WARNED] = mode._warned_trace


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    reason = NOT_APPLICABLE.get(getattr(item, "originalname", ""))
    model = getattr(getattr(item, "callspec", None), "params", {}).get("model_name")
    if reason is None or model not in MOE_NAMES or call.when != "call" or call.excinfo is None:
        return report
    error = call.excinfo.value
    refused = (isinstance(error, NotScriptableError) and "torch.export" in str(error) if reason is SCRIPT
               else isinstance(error, AssertionError) and item.stash.get(WARNED, False))
    if refused:
        report.outcome, report.wasxfail = "skipped", f"not applicable: {reason}"
    return report

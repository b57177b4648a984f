"""A registered spec's name is a timm name like the backbone's (issue 63, point 2): timm's registry has its
pretrained cfg and lists it under the backbone's module; `timm.create_model` takes `device=`, `dtype=`,
`pretrained_cfg_overlay=` and `features_only=` as for the dense model, and raises timm's own exception types.
Each behaviour is compared, through timm itself, with the dense backbone's, over four families."""

from __future__ import annotations

import pickle

import pytest
import timm
import torch
from timm.models import get_pretrained_cfg, get_pretrained_cfg_value, save_for_hf

import moespec
from moespec.errors import Problem, SpecError, raised_as_timm
from moespec.spec import HUB_ARCHITECTURE

MOE = [{"where": {"every": 1}, "experts": 4, "router": {"kind": "topk", "top_k": 2}}]
BACKBONES = {  # tiny real timm classes; three ViT-like blocks so that timm's default last-3 features exist
    "vit": {"model": "vit_small_patch16_224",
            "kwargs": {"depth": 3, "img_size": 32, "patch_size": 8, "embed_dim": 32, "num_heads": 2}},
    "convnext": {"model": "convnext_atto", "kwargs": {"depths": [1, 1, 1, 1], "dims": [8, 16, 32, 64]}},
    "eva": {"model": "eva02_tiny_patch14_224", "kwargs": {"depth": 3, "img_size": 28, "embed_dim": 32, "num_heads": 2}},
    "swin": {"model": "swin_tiny_patch4_window7_224",
             "kwargs": {"depths": [1, 1], "num_heads": [1, 2], "embed_dim": 16, "img_size": 32, "window_size": 4}},
}
MODULES = {"vit": "vision_transformer", "convnext": "convnext", "eva": "eva", "swin": "swin_transformer"}
SIZES = {"vit": (3, 32, 32), "convnext": (3, 224, 224), "eva": (3, 28, 28), "swin": (3, 32, 32)}  # img_size, else 224
RUN_SIZES = {**SIZES, "convnext": (3, 32, 32)}  # what the forwards take here: a ConvNeXt takes any size
FAMILIES = list(BACKBONES)


def _register(family: str, **backbone) -> str:
    document = {"name": f"tiny-{family}-moe", "backbone": {**BACKBONES[family], **backbone}, "moe": MOE}
    return moespec.register_timm(moespec.load_spec(document), name=f"moespec_test_names_{family}")


def _dense(family: str, **kwargs) -> torch.nn.Module:
    backbone = BACKBONES[family]
    return timm.create_model(backbone["model"], **backbone["kwargs"], **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_name_has_its_backbones_pretrained_cfg_at_the_specs_input_size(family):
    name = _register(family)
    cfg, dense = get_pretrained_cfg(name, allow_unregistered=False), get_pretrained_cfg(BACKBONES[family]["model"])
    assert get_pretrained_cfg_value(name, "input_size") == cfg.input_size == SIZES[family]
    for key in ("mean", "std", "interpolation", "crop_pct", "crop_mode", "first_conv", "classifier", "license"):
        assert getattr(cfg, key) == getattr(dense, key), key
    assert cfg.architecture == name and "moespec" in cfg.description and BACKBONES[family]["model"] in cfg.description
    assert not cfg.has_weights  # the dense model's timm weights are not this name's
    model = timm.create_model(name)
    assert model.pretrained_cfg["input_size"] == SIZES[family]
    assert model.pretrained_cfg["architecture"] == HUB_ARCHITECTURE  # so that save_for_hf's folder builds anywhere
    assert timm.data.resolve_data_config({}, model=model)["input_size"] == SIZES[family]
    x = torch.randn(1, *RUN_SIZES[family])
    assert model.eval()(x).shape == _dense(family).eval()(x).shape


@pytest.mark.parametrize("family", FAMILIES)
def test_list_models_finds_the_name_as_it_finds_the_backbone(family):
    name, backbone = _register(family), BACKBONES[family]["model"]
    assert name in timm.list_models("*moe*") and name in timm.list_models(f"*{family}*")
    assert {name, backbone} <= set(timm.list_models(module=MODULES[family]))
    assert timm.models.is_model_in_modules(name, MODULES[family])
    assert timm.models.model_entrypoint(name, module_filter=MODULES[family]) is not None
    assert {name, backbone} <= set(timm.list_models(name_matches_cfg=True))
    weighted = timm.list_models(pretrained=True, include_tags=False)
    assert backbone in weighted and name not in weighted
    assert not any(n.startswith(name) for n in timm.list_pretrained())


def test_weights_are_listed_only_where_the_spec_names_its_dense_source(dense_checkpoint):
    path, _ = dense_checkpoint(BACKBONES["vit"])
    name = _register("vit", checkpoint=str(path))
    assert name in timm.list_models(pretrained=True) and name in timm.list_pretrained("moespec_test_names_*")
    assert name in timm.list_models(pretrained=True, include_tags=False)
    assert get_pretrained_cfg(name).file == str(path) and timm.models.is_model_pretrained(name)
    assert timm.create_model(name, pretrained=True).moespec_spec.backbone.checkpoint == str(path)
    dense = get_pretrained_cfg(BACKBONES["vit"]["model"])
    assert _register("vit", pretrained=True) == name  # timm's weights, as the spec says (nothing is downloaded here)
    assert name in timm.list_models(pretrained=True, include_tags=False)
    assert (get_pretrained_cfg(name).hf_hub_id, get_pretrained_cfg(name).url) == (dense.hf_hub_id, dense.url)
    assert _register("vit") == name  # registered again without a source: no weights left listed, one module
    assert name not in timm.list_models(pretrained=True) and not get_pretrained_cfg(name).has_weights
    assert [m for m in timm.list_modules() if name in timm.list_models(module=m)] == ["vision_transformer"]


@pytest.mark.parametrize("family", FAMILIES)
def test_device_and_dtype_place_the_model_as_they_place_the_dense_one(family):
    name = _register(family)
    for kwargs in ({"device": "cpu"}, {"device": "meta"}, {"dtype": torch.bfloat16}):
        moe, dense = timm.create_model(name, **kwargs), _dense(family, **kwargs)
        placed = {(p.device, p.dtype) for p in moe.parameters()}
        assert placed == {(p.device, p.dtype) for p in dense.parameters()}, kwargs
        assert "device" not in moe.moespec_spec.backbone.kwargs and "dtype" not in moe.moespec_spec.backbone.kwargs


def test_a_hub_folder_takes_device_and_dtype(tmp_path):
    name = _register("eva")  # EVA's build on the meta device is where device="cpu" broke
    save_for_hf(timm.create_model(name), tmp_path / "hub", safe_serialization=True)
    model = timm.create_model(f"local-dir:{tmp_path / 'hub'}", pretrained=True, device="cpu", dtype=torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cpu", torch.bfloat16)}
    assert {p.device.type for p in timm.create_model(f"local-dir:{tmp_path / 'hub'}", device="meta").parameters()} \
        == {"meta"}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("out_indices", [None, (0, 1)], ids=["default", "0-1"])
def test_features_only_gives_the_feature_backbone_timm_gives_the_dense_model(family, out_indices):
    name = _register(family)
    kwargs = {"features_only": True} if out_indices is None else {"features_only": True, "out_indices": out_indices}
    moe, dense = timm.create_model(name, **kwargs), _dense(family, **kwargs)
    assert type(moe) is type(dense)  # ConvNeXt and Swin: FeatureListNet; ViT and EVA: FeatureGetterNet
    assert moe.feature_info.channels() == dense.feature_info.channels()
    assert moe.feature_info.reduction() == dense.feature_info.reduction()
    x = torch.randn(2, *RUN_SIZES[family])
    assert [o.shape for o in moe(x)] == [o.shape for o in dense(x)]
    assert moe.pretrained_cfg["input_size"] == SIZES[family] and "num_classes" not in moe.pretrained_cfg
    assert len(moespec.moe_layers(moe)) > 0
    if hasattr(dense, "set_grad_checkpointing"):
        moe.set_grad_checkpointing(True)


@pytest.mark.parametrize("family", ["vit", "convnext"])
def test_a_feature_index_the_family_cannot_give_is_refused_as_timm_refuses_it(family):
    with pytest.raises(Exception) as dense:
        _dense(family, features_only=True, out_indices=(7,))
    with pytest.raises(type(dense.value)) as moe:
        timm.create_model(_register(family), features_only=True, out_indices=(7,))
    assert str(moe.value) == str(dense.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_timms_exception_types_come_through(family):
    name = _register(family)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_kwarg'"):
        _dense(family, no_such_kwarg=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_kwarg'") as moe:
        timm.create_model(name, no_such_kwarg=1)
    assert isinstance(moe.value, moespec.MoespecError) and "timm rejected the kwargs" in str(moe.value)
    with pytest.raises(AssertionError):
        _dense(family, global_pool="no_such_pool")
    with pytest.raises(AssertionError, match="backbone.kwargs: timm could not build"):
        timm.create_model(name, global_pool="no_such_pool")
    with pytest.raises(RuntimeError, match="Invalid pretrained tag"):
        timm.create_model(f"{name}.no_such_tag")


@pytest.mark.parametrize("family", ["vit", "convnext"])
def test_pretrained_cfg_overlay_reaches_the_model_as_the_dense_ones(family):
    overlay = {"mean": (0.1, 0.2, 0.3), "crop_pct": 0.5}
    moe, dense = timm.create_model(_register(family), pretrained_cfg_overlay=overlay), _dense(
        family, pretrained_cfg_overlay=overlay)
    for key, value in overlay.items():
        assert moe.pretrained_cfg[key] == dense.pretrained_cfg[key] == value


def test_raised_as_timm_keeps_the_spec_error_and_survives_a_pickle():
    timm_error = AssertionError("Invalid pool type: x")
    error = raised_as_timm(SpecError(Problem("timm could not build", path="backbone.kwargs"), timm_error=timm_error))
    assert isinstance(error, AssertionError) and isinstance(error, SpecError)
    assert error.problems[0].path == "backbone.kwargs" and error.timm_error is timm_error
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error) and str(again.timm_error) == str(timm_error)
    # a type whose constructor takes more than a message: its nearest base that takes one
    decode = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    raised = raised_as_timm(SpecError("x", timm_error=decode))
    assert isinstance(raised, UnicodeError) and not isinstance(raised, UnicodeDecodeError)
    assert isinstance(raised, SpecError) and raised.timm_error is decode
    plain = SpecError("a spec problem of moespec's own")
    assert raised_as_timm(plain) is plain

"""Every refusal of a Hub folder's config.json names the file, the field, what was found and the real fix, and
never contradicts itself (issue 64, Reliability V): a moespec architecture is never "not a moespec model", a
missing spec never says to upcycle a dense checkpoint."""

from __future__ import annotations

import hashlib
import json

import pytest
import timm
from typer.testing import CliRunner

import moespec
from moespec.cli import app
from moespec.spec import HUB_ARCHITECTURE

from .test_hub_folder import LABELS, _model

SPEC_KEY, HASH_KEY, VERSION_KEY = "moespec.spec", "moespec.spec_sha256", "moespec.version"


def _carried(config):
    return config["model_args"]["moespec"]


def _respec(config, yaml_text, version=None):
    """Replace the carried spec's YAML, with a hash that matches it (so that only the YAML is wrong)."""
    carried = _carried(config)
    carried[SPEC_KEY] = yaml_text
    carried[HASH_KEY] = hashlib.sha256(yaml_text.encode()).hexdigest()
    if version is not None:
        carried[VERSION_KEY] = version


def _bad_experts(config):
    return _carried(config)[SPEC_KEY].replace("experts: 4", "experts: 0")


def _future_field(config):
    """The carried spec with a field this moespec does not know (as a newer moespec's spec may have)."""
    return _carried(config)[SPEC_KEY] + "future_option: 1\n"


def _set(path, value):
    def change(config):
        *parents, last = path
        holder = config
        for key in parents:
            holder = holder[key]
        holder[last] = value
    return change


def _drop(path):
    def change(config):
        *parents, last = path
        holder = config
        for key in parents:
            holder = holder[key]
        del holder[last]
    return change


def _layout(number, version):
    """Another moespec Hub layout's architecture, written by moespec `version` (None: this one)."""
    def change(config):
        config["architecture"] = f"moespec_v{number}_pip_install_and_import_moespec"
        if version is not None:
            _carried(config)[VERSION_KEY] = version
    return change


# id -> (change to the written config.json, the field the message names, words of the fix it gives)
BROKEN = {
    "architecture missing": (_drop(["architecture"]), "architecture: missing", "save_for_hf"),
    "architecture a number": (_set(["architecture"], 42), "architecture: a number", "save_for_hf"),
    "architecture newer layout": (_layout(2, "99.0.0"), "architecture:", "upgrade moespec"),
    "architecture older layout": (_layout(0, "0.0.1"), "architecture:", "save it again with this one"),
    "architecture layout edited": (_layout(2, None), "architecture:", "the file was edited"),
    "architecture moespec-like": (_set(["architecture"], "moespec_model"), "architecture:", "set it back"),
    "architecture timm's": (_set(["architecture"], "vit_small_patch16_224"), "architecture:", "timm.create_model"),
    "model_args missing": (_drop(["model_args"]), "model_args: missing", "save_for_hf"),
    "model_args a list": (_set(["model_args"], []), "model_args: a list", "save_for_hf"),
    "spec missing": (_drop(["model_args", "moespec"]), "model_args.moespec: missing", "save_for_hf"),
    "spec a string": (_set(["model_args", "moespec"], "name: x"), "model_args.moespec: a string", "save_for_hf"),
    "spec yaml missing": (_drop(["model_args", "moespec", SPEC_KEY]), f"model_args.moespec['{SPEC_KEY}']: missing",
                          "save_for_hf"),
    "spec hash missing": (_drop(["model_args", "moespec", HASH_KEY]), f"model_args.moespec['{HASH_KEY}']",
                          "save_for_hf"),
    "spec edited": (lambda c: _carried(c).update({SPEC_KEY: _bad_experts(c)}),
                    f"model_args.moespec['{HASH_KEY}']: does not match", "edit a spec file"),
    "spec invalid": (lambda c: _respec(c, _future_field(c)), "model_args.moespec", "future_option"),
    "spec unfit for its backbone": (lambda c: _respec(c, _bad_experts(c)), "model_args.moespec", "experts: 0"),
    "spec of a newer moespec": (lambda c: _respec(c, _future_field(c), version="99.0.0"), "model_args.moespec",
                                "upgrade moespec"),
    "num_classes clash": (_set(["num_classes"], 7), "num_classes: 7", "set num_classes to 3"),
    "num_classes a string": (_set(["num_classes"], "3"), "num_classes: a string", "head's size, 3"),
    "pretrained_cfg a list": (_set(["pretrained_cfg"], [1]), "pretrained_cfg: a list", "save_for_hf"),
    "pretrained_cfg num_classes clash": (_set(["pretrained_cfg", "num_classes"], 9), "pretrained_cfg.num_classes: 9",
                                         "set pretrained_cfg.num_classes to 3"),
    "label_names too few": (_set(["label_names"], ["cat"]), "label_names: 1 names", "one name per class"),
    "label_names not strings": (_set(["label_names"], [1, 2, 3]), "label_names: a list", "label_names"),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("hub")
    folder = moespec.save_for_hf(_model(tmp_path), tmp_path / "hub", model_config={"label_names": LABELS})
    return folder


@pytest.fixture(params=sorted(BROKEN))
def broken(request, written, tmp_path):
    """A copy of the written folder with one field of its config.json broken; the field and fix it must name."""
    change, field, fix = BROKEN[request.param]
    folder = tmp_path / "hub"
    folder.mkdir()
    for file in written.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((written / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder, config, field, fix


def _consistent(message, config, field, fix):
    assert "config.json" in message and field in message and fix in message, message
    architecture = config.get("architecture")
    if isinstance(architecture, str) and architecture.startswith("moespec"):
        assert "not a moespec" not in message and "a timm model" not in message, message
    assert "upcycle SPEC --checkpoint" not in message and "dense checkpoint" not in message, message


def test_each_broken_field_is_one_message_that_names_it_and_its_fix(broken):
    folder, config, field, fix = broken
    with pytest.raises(moespec.MoespecError) as raised:
        moespec.load(folder)
    _consistent(str(raised.value), config, field, fix)


def test_the_cli_exits_2_with_that_message(broken):
    folder, config, field, fix = broken
    result = CliRunner().invoke(app, ["stats", str(folder)])
    assert result.exit_code == 2, result.output
    _consistent(" ".join(result.output.split()), config, field, fix)  # the terminal wraps long lines
    assert "Traceback" not in result.output


def test_timm_gives_the_same_message_where_it_calls_moespec(broken):
    """timm calls moespec's entry point only for this moespec's architecture (it refuses others itself, before
    moespec is asked): from there, the same located message."""
    folder, config, field, fix = broken
    if config.get("architecture") != HUB_ARCHITECTURE or not isinstance(config.get("pretrained_cfg"), dict) \
            or not isinstance(config.get("model_args", {}), dict):
        pytest.skip("timm refuses this config.json itself, before it calls moespec")
    if field.startswith("label_names"):
        pytest.skip("timm moves the root label_names into pretrained_cfg; checked there")
    with pytest.raises(moespec.MoespecError) as raised:
        timm.create_model(f"local-dir:{folder}", pretrained=True)
    message = str(raised.value)
    assert "config.json" in message and fix in message, message
    if not field.startswith("num_classes"):  # timm merges the root num_classes into pretrained_cfg
        assert field in message, message


def test_the_written_config_passes_every_check(written):
    """The checks above refuse only what was broken: the folder as written loads."""
    assert moespec.load(written).num_classes == len(LABELS)
    assert timm.create_model(f"local-dir:{written}", pretrained=True).pretrained_cfg["label_names"] == LABELS

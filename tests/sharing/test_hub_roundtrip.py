"""timm's own export and import round-trip a moespec model (issue 48, points 1 and 2): `save_for_hf` writes a
folder that `timm.create_model("local-dir:...")` and `("hf-hub:...")` build again as the same MoE model, with
its pretrained_cfg; moespec's tools read the folder too; and nothing builds another model in its place."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import timm
import timm.models._hub
import torch
from timm.models import save_for_hf
from typer.testing import CliRunner

import moespec
from moespec.cli import app
from moespec.spec import HUB_ARCHITECTURE, spec_metadata

from ..conftest import randomize

VIT = {"name": "tiny-vit-moe", "input_size": [3, 32, 32],
       "backbone": {"model": "vit_small_patch16_224",
                    "kwargs": {"depth": 2, "embed_dim": 64, "num_heads": 2, "img_size": 32, "patch_size": 8,
                               "num_classes": 5}},
       "moe": [{"where": {"every": 1}, "experts": 4, "router": {"kind": "topk", "top_k": 2}}]}
CONVNEXT = {"name": "tiny-convnext-moe", "input_size": [3, 32, 32],
            "backbone": {"model": "convnext_atto", "kwargs": {"depths": [1, 1, 2, 1], "num_classes": 5}},
            "moe": [{"where": {"last": 2}, "experts": 2, "router": {"kind": "topk", "top_k": 1}}]}
LABELS = ["cat", "dog", "fox", "owl", "yak"]


def _trained(document: dict) -> torch.nn.Module:
    """A moespec model with weights unlike any fresh build (so equal outputs mean its weights were read)."""
    return randomize(moespec.create_model(moespec.load_spec(document), seed=0), seed=1).eval()


def _plain(cfg: dict) -> dict:
    """A config with tuples as lists, as JSON gives them back."""
    return json.loads(json.dumps(cfg))


def _same_outputs(a: torch.nn.Module, b: torch.nn.Module) -> None:
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(a.eval()(x), b.eval()(x), rtol=0, atol=0)


@pytest.mark.parametrize("document", [VIT, CONVNEXT], ids=["vit", "convnext"])
def test_save_for_hf_then_local_dir_builds_the_same_moe_model(tmp_path, document):
    model = _trained(document)
    save_for_hf(model, tmp_path / "hub", safe_serialization=True, model_config={"label_names": LABELS})
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    assert config["architecture"] == HUB_ARCHITECTURE

    loaded = timm.create_model(f"local-dir:{tmp_path / 'hub'}", pretrained=True)
    assert type(loaded) is type(model) and list(moespec.moe_layers(loaded)) == list(moespec.moe_layers(model))
    _same_outputs(model, loaded)
    cfg, dense = _plain(loaded.pretrained_cfg), _plain(model.pretrained_cfg)  # dense: the backbone's own cfg
    for key in ("mean", "std", "crop_pct", "crop_mode", "interpolation"):
        assert cfg[key] == dense[key], key
    size = [3, 32, 32] if document is VIT else dense["input_size"]  # a ViT's img_size; a ConvNeXt takes any size
    assert (cfg["num_classes"], cfg["label_names"], cfg["input_size"]) == (5, LABELS, size)
    data = _plain(timm.data.resolve_data_config({}, model=loaded))
    assert data == {"input_size": size, "interpolation": dense["interpolation"], "mean": dense["mean"],
                    "std": dense["std"], "crop_pct": dense["crop_pct"], "crop_mode": dense["crop_mode"]}

    # moespec's own tools read the folder: load, stats, plan
    _same_outputs(model, moespec.load(tmp_path / "hub"))
    assert moespec.load(tmp_path / "hub").moespec_spec.moe == model.moespec_spec.moe
    for command in ("stats", "plan"):
        result = CliRunner().invoke(app, [command, str(tmp_path / "hub")])
        assert result.exit_code == 0, result.output
        assert "MoE" in result.output or "moe" in result.output.lower()


def test_pickled_weights_and_a_new_head(tmp_path):
    """timm's default export writes pytorch_model.bin; `num_classes` other than the saved one fine-tunes from the
    folder: every weight but the head's is the saved model's (timm's rule for its own models)."""
    model = _trained(VIT)
    save_for_hf(model, tmp_path / "hub")
    assert (tmp_path / "hub" / "pytorch_model.bin").is_file()
    _same_outputs(model, timm.create_model(f"local-dir:{tmp_path / 'hub'}", pretrained=True))
    _same_outputs(model, moespec.load(tmp_path / "hub"))
    tuned = timm.create_model(f"local-dir:{tmp_path / 'hub'}", pretrained=True, num_classes=3)
    assert tuned.num_classes == 3 and tuned.head.out_features == 3
    torch.testing.assert_close(tuned.blocks[1].mlp.experts.fc1.weight, model.blocks[1].mlp.experts.fc1.weight)


def test_hf_hub_reads_the_same_files_through_timms_code(tmp_path, monkeypatch):
    """push_to_hf_hub uploads what save_for_hf writes; `hf-hub:` reads it back through timm's own functions,
    here with the download answered from the folder (no network)."""
    model = _trained(VIT)
    save_for_hf(model, tmp_path / "hub", safe_serialization="both", model_config={"label_names": LABELS})
    asked = []

    def download(repo_id, filename, revision=None, cache_dir=None, **_):
        asked.append((repo_id, filename))
        path = tmp_path / "hub" / filename
        if not path.is_file():
            raise timm.models._hub.EntryNotFoundError(filename)
        return str(path)

    monkeypatch.setattr(timm.models._hub, "hf_hub_download", download)
    loaded = timm.create_model("hf-hub:someone/tiny-vit-moe", pretrained=True)
    assert ("someone/tiny-vit-moe", "config.json") in asked and ("someone/tiny-vit-moe", "model.safetensors") in asked
    _same_outputs(model, loaded)
    assert loaded.pretrained_cfg["label_names"] == LABELS and loaded.pretrained_cfg["source"] == "hf-hub"


def test_push_to_hf_hub_uploads_a_folder_that_builds_the_model(tmp_path, monkeypatch):
    """timm's push_to_hf_hub, run to its upload (the Hub API answered here): what it uploads loads back."""
    import shutil
    from types import SimpleNamespace

    class Hub:
        def __init__(self, **_):
            pass

        def create_repo(self, repo_id, **_):
            return SimpleNamespace(repo_id=repo_id)

        def file_exists(self, **_):
            return False

        def upload_folder(self, repo_id, folder_path, **_):
            shutil.copytree(folder_path, tmp_path / "uploaded")
            return "uploaded"

    monkeypatch.setattr(timm.models._hub, "HfApi", Hub)
    model = _trained(VIT)
    assert timm.models.push_to_hf_hub(model, "someone/tiny-vit-moe") == "uploaded"
    assert {"config.json", "model.safetensors", "pytorch_model.bin", "README.md"} <= {
        p.name for p in (tmp_path / "uploaded").iterdir()}
    _same_outputs(model, timm.create_model(f"local-dir:{tmp_path / 'uploaded'}", pretrained=True))


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)


def test_without_moespec_timm_refuses_the_folder(tmp_path):
    """In a process that never imports moespec, timm does not know the architecture and says what to do."""
    save_for_hf(_trained(VIT), tmp_path / "hub", safe_serialization=True)
    done = _fresh_python(f"import timm\ntry:\n    timm.create_model({f'local-dir:{tmp_path / chr(104)}ub'!r})\n"
                         f"except RuntimeError as e:\n    print('refused:', e)")
    assert done.stdout.strip() == f"refused: Unknown model ({HUB_ARCHITECTURE})", done.stderr[-2000:]
    assert "pip_install_and_import_moespec" in HUB_ARCHITECTURE


@pytest.mark.slow
def test_importing_moespec_before_or_after_timm_registers_the_architecture(tmp_path):
    """Once moespec is imported, after timm or before it (its registration then waits for timm's import), timm
    builds the model; also where something probes for timm's spec between the two imports, as transformers
    does (issue 63, point 7). Three fresh interpreters, two at a time."""
    save_for_hf(_trained(VIT), tmp_path / "hub", safe_serialization=True)
    built = "{}\nm = timm.create_model(" + repr(f"local-dir:{tmp_path / 'hub'}") + ", pretrained=True)\n" \
            "print(type(m).__name__, len(moespec.moe_layers(m)))"
    probe = "import importlib.util, moespec\nassert importlib.util.find_spec('timm')\nimport timm"  # as transformers
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(_fresh_python, [built.format(first) for first in (
            "import moespec, timm", "import timm, moespec", probe)]))
    for run in done:
        assert run.stdout.split() == ["VisionTransformer", "2"], run.stderr[-2000:]


def _rewrite_spec(folder, change) -> None:
    config = json.loads((folder / "config.json").read_text())
    spec = moespec.load_spec(json.loads(json.dumps(moespec.load(folder).moespec_spec.model_dump(mode="json"))))
    document = spec.model_dump(mode="json")
    change(document)
    config["model_args"]["moespec"] = spec_metadata(moespec.load_spec(document))
    (folder / "config.json").write_text(json.dumps(config))


def test_weights_that_do_not_fit_the_spec_are_refused(tmp_path):
    save_for_hf(_trained(VIT), tmp_path / "hub", safe_serialization=True)
    _rewrite_spec(tmp_path / "hub", lambda d: d["moe"][0].update(experts=8))
    with pytest.raises(moespec.CheckpointError, match="config.json"):
        timm.create_model(f"local-dir:{tmp_path / 'hub'}", pretrained=True)
    with pytest.raises(moespec.CheckpointError):
        moespec.load(tmp_path / "hub")


def test_an_altered_spec_and_a_newer_moespecs_spec_are_refused(tmp_path):
    save_for_hf(_trained(VIT), tmp_path / "hub", safe_serialization=True)
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    carried = config["model_args"]["moespec"]
    carried["moespec.spec"] = carried["moespec.spec"].replace("experts: 4", "experts: 8")
    (tmp_path / "hub" / "config.json").write_text(json.dumps(config))
    with pytest.raises(moespec.CheckpointError, match="spec_sha256.*: does not match the spec.s YAML"):
        timm.create_model(f"local-dir:{tmp_path / 'hub'}", pretrained=True)

    newer = carried["moespec.spec"].replace("kind: topk", "kind: a_router_of_the_future")
    config["model_args"]["moespec"] = {**spec_metadata(moespec.load_spec(VIT)), "moespec.spec": newer,
                                       "moespec.spec_sha256": __import__("hashlib").sha256(newer.encode()).hexdigest(),
                                       "moespec.version": "99.0.0"}
    (tmp_path / "hub" / "config.json").write_text(json.dumps(config))
    with pytest.raises(moespec.MoespecError, match=r"written by moespec 99\.0\.0.*upgrade moespec"):
        timm.create_model(f"local-dir:{tmp_path / 'hub'}")
    result = CliRunner().invoke(app, ["stats", str(tmp_path / "hub")])
    assert result.exit_code == 2 and "upgrade moespec" in result.output


def test_a_registered_names_pretrained_cfg_is_kept_and_travels(tmp_path):
    """timm's `pretrained_cfg_overlay` reaches a registered spec's model (it was dropped), and the folder keeps it."""
    name = moespec.register_timm(moespec.load_spec(VIT), name="moespec_test_hub_cfg")
    model = timm.create_model(name, pretrained_cfg_overlay={"crop_pct": 0.95, "interpolation": "bilinear"})
    assert timm.data.resolve_data_config({}, model=model)["crop_pct"] == 0.95
    save_for_hf(model, tmp_path / "hub", safe_serialization=True)
    loaded = timm.create_model(f"local-dir:{tmp_path / 'hub'}", pretrained=True)
    data = timm.data.resolve_data_config({}, model=loaded)
    assert (data["crop_pct"], data["interpolation"]) == (0.95, "bilinear")
    _same_outputs(model, loaded)

"""Upcycling from several dense checkpoints (mergekit-moe's experts from several models): which source each
expert and everything else takes, the average base, mismatched sources, and the report's account of the start."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

import moespec
from moespec.cli import app
from moespec.errors import CheckpointError, SpecError
from moespec.weights import upcycle_to_checkpoint, upcycle_with_report

from ..conftest import make_spec

# a ViT of 2 blocks, width 32, hidden 128, 16 tokens + [CLS] at 32 px
SMALL = {"model": "vit_small_patch16_224", "kwargs": {"depth": 2, "img_size": 32, "patch_size": 8, "embed_dim": 32,
                                                       "num_heads": 2, "num_classes": 5}}
INPUT = [3, 32, 32]


def spec_of(moe: list[dict], **upcycle) -> moespec.Spec:
    return make_spec(SMALL, moe, input_size=INPUT, upcycle=upcycle)


def two_sources(dense_checkpoint):
    (a, dense_a), (b, dense_b) = (dense_checkpoint(SMALL, name=f"{n}.safetensors", seed=i)
                                  for i, n in enumerate("ab"))
    return [a, b], [dense_a.state_dict(), dense_b.state_dict()]


FOUR = [{"where": {"every": 1}, "experts": 4, "shared_experts": 1, "router": {"top_k": 1, "normalize": True}}]


def test_expert_i_takes_source_i_mod_n_and_the_rest_comes_from_the_first(dense_checkpoint):
    paths, (a, b) = two_sources(dense_checkpoint)
    state = moespec.upcycle(spec_of(FOUR), paths).state_dict()
    for e, source in enumerate([a, b, a, b]):
        for ffn in ("blocks.0.mlp", "blocks.1.mlp"):
            assert torch.equal(state[f"{ffn}.experts.fc1.weight"][e], source[f"{ffn}.fc1.weight"])
            assert torch.equal(state[f"{ffn}.experts.fc2.bias"][e], source[f"{ffn}.fc2.bias"])
    assert torch.equal(state["blocks.1.mlp.shared.fc1.weight"][0], a["blocks.1.mlp.fc1.weight"])  # the base's FFN
    for name in ("blocks.0.attn.qkv.weight", "blocks.1.norm2.weight", "pos_embed", "head.weight"):
        assert torch.equal(state[name], a[name])


def test_experts_from_and_the_average_base(dense_checkpoint):
    paths, (a, b) = two_sources(dense_checkpoint)
    state = moespec.upcycle(spec_of(FOUR, experts_from=[1, 1, 0, 1], base="average"), paths).state_dict()
    for e, source in enumerate([b, b, a, b]):
        assert torch.equal(state["blocks.0.mlp.experts.fc1.weight"][e], source["blocks.0.mlp.fc1.weight"])
    for name in ("blocks.0.attn.qkv.weight", "cls_token", "head.bias"):  # (a + b) / 2, element by element
        torch.testing.assert_close(state[name], (a[name] + b[name]) / 2, rtol=0, atol=1e-7)
    torch.testing.assert_close(state["blocks.0.mlp.shared.fc2.weight"][0],
                               (a["blocks.0.mlp.fc2.weight"] + b["blocks.0.mlp.fc2.weight"]) / 2, rtol=0, atol=1e-7)


def test_the_average_leaves_out_a_head_a_source_does_not_have(dense_checkpoint):
    """Source 1 was fine-tuned for 7 classes: its head is dropped, and the 5-class head is source 0's alone."""
    (a, dense_a) = dense_checkpoint(SMALL, name="a.safetensors", seed=0)
    other = {**SMALL, "kwargs": {**SMALL["kwargs"], "num_classes": 7}}
    (b, dense_b) = dense_checkpoint(other, name="b.safetensors", seed=1)
    state = moespec.upcycle(spec_of(FOUR, base="average"), [a, b]).state_dict()
    assert torch.equal(state["head.weight"], dense_a.state_dict()["head.weight"])
    name = "blocks.1.norm1.weight"
    torch.testing.assert_close(state[name], (dense_a.state_dict()[name] + dense_b.state_dict()[name]) / 2)


def test_a_source_of_another_shape_is_refused_naming_it_and_the_tensor(dense_checkpoint):
    (a, _) = dense_checkpoint(SMALL, name="a.safetensors")
    wider = {**SMALL, "kwargs": {**SMALL["kwargs"], "mlp_ratio": 2.0}}
    (b, _) = dense_checkpoint(wider, name="b.safetensors")
    with pytest.raises(CheckpointError) as err:
        moespec.upcycle(spec_of(FOUR), [a, b])
    first = str(err.value).splitlines()[0]
    assert first.startswith(f"source 1 ({b}): checkpoint {b} does not fit the backbone")
    assert "shape mismatches: blocks.0.mlp.fc1.weight: checkpoint (64, 32) vs model (128, 32)" in str(err.value)


def test_experts_from_naming_a_source_not_given_is_located(dense_checkpoint):
    paths, _ = two_sources(dense_checkpoint)
    with pytest.raises(SpecError) as err:
        moespec.upcycle(spec_of(FOUR, experts_from=[0, 1, 2, 0]), paths)
    problem, = err.value.problems
    assert problem.path == "upcycle.experts_from"
    assert problem.message == ("names source 2, but 2 checkpoints were given (sources 0 to 1); give more checkpoints "
                               "or name sources below 2")


def test_the_report_names_sources_and_the_logit_error_against_each(dense_checkpoint):
    """Every expert from source 0, normalized top-1: the MoE model computes source 0's function, so its relative
    logit error against source 0 is 0 and against source 1 is ||d0(x) - d1(x)|| / ||d1(x)|| on the images given."""
    paths, _ = two_sources(dense_checkpoint)
    x = torch.randn(6, *INPUT, generator=torch.Generator().manual_seed(5))
    moe = [{"where": {"every": 1}, "experts": 4, "router": {"top_k": 1, "normalize": True}}]
    model, report = upcycle_with_report(spec_of(moe, experts_from=[0, 0, 0, 0]), paths, images=x)
    dense = [moespec.weights.dense_model(spec_of(moe), p)[0].eval() for p in paths]
    with torch.no_grad():
        d0, d1 = dense[0](x), dense[1](x)
    expected = ((d0 - d1).norm() / d1.norm()).item()
    assert report.source_errors[0] <= 1e-6
    assert report.source_errors[1] == pytest.approx(expected, rel=1e-5)
    assert report.start_lines() == [
        f"source 0: {paths[0]}", f"source 1: {paths[1]}", "outside the experts: source 0 (base: first)",
        "blocks.0.mlp: experts from sources [0 0 0 0]; router N(0, 0.02^2)",
        "blocks.1.mlp: experts from sources [0 0 0 0]; router N(0, 0.02^2)",
        f"relative logit error ||MoE - dense|| / ||dense|| on 6 of the images given: source 0 "
        f"{report.source_errors[0]:.4g}, source 1 {report.source_errors[1]:.4g}"]


def test_streamed_weights_equal_the_in_memory_upcycle_from_several_sources(dense_checkpoint, tmp_path):
    paths, _ = two_sources(dense_checkpoint)
    images = [torch.randn(5, *INPUT, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    spec = spec_of(FOUR, router_init="hidden", drop=0.25, noise=0.01, base="average")
    out = tmp_path / "moe.safetensors"
    _, report = upcycle_to_checkpoint(spec, out, checkpoint=paths, images=images, seed=3)
    expected = moespec.upcycle(spec, paths, images=images, seed=3).state_dict()
    with safe_open(str(out), "pt") as f:
        assert set(f.keys()) == set(expected)
        for name in expected:
            assert torch.equal(f.get_tensor(name), expected[name]), name
    assert len(report.source_errors) == 2 and report.compared_on == "10 of the images given"


def test_cli_takes_several_sources_and_an_image_folder_per_source(dense_checkpoint, tmp_path):
    from PIL import Image

    paths, _ = two_sources(dense_checkpoint)
    for source, colour in (("a", (200, 0, 0)), ("b", (0, 0, 200))):
        (tmp_path / source).mkdir()
        for i in range(3):
            Image.new("RGB", (40, 40), (colour[0], 20 * i, colour[2])).save(tmp_path / source / f"{i}.png")
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"backbone: {SMALL}\ninput_size: {INPUT}\nmoe:\n  - {{where: {{every: 1}}, experts: 4}}\n"
                    f"upcycle: {{router_init: hidden}}\n")
    runner = CliRunner()
    args = ["upcycle", str(spec), *map(str, paths), "-o", str(tmp_path / "out.safetensors")]
    run = runner.invoke(app, [*args, "--images", str(tmp_path / "a")])
    assert run.exit_code == 2
    assert run.output.strip() == (f"moespec: error: {spec}:5:11: upcycle.router_init: hidden needs one image folder "
                                  f"or batch per source: 2 sources, 1 image set(s) given (--images DIR once per "
                                  f"source, in the sources' order)")
    run = runner.invoke(app, [*args, "--images", str(tmp_path / "a"), "--images", str(tmp_path / "b")])
    assert run.exit_code == 0, run.output
    assert ("blocks.0.mlp: experts from sources [0 1 0 1]; router hidden: each row along the mean router input of "
            "its source's images (3 for source 0, 3 for source 1)") in run.output
    assert "relative logit error ||MoE - dense|| / ||dense|| on 6 of the images given: source 0 " in run.output
    run = runner.invoke(app, [*args[:2], str(paths[0]), "--checkpoint", str(paths[1]), *args[4:]])
    assert run.exit_code == 2 and "as arguments or with --checkpoint, not both" in run.output


@pytest.mark.parametrize("upcycle,field,message", [
    ({"experts_from": [0, 1, 0]}, "upcycle.experts_from",
     "has 3 entries, one per routed expert, but moe.0.experts is 4"),
    ({"router_init": "kmeans"}, "upcycle.router_init",
     "kmeans starts one gate row per expert, and moe.0 (Soft MoE) has none; use normal or zeros"),
    ({"drop": 1.5}, "upcycle.drop", "input should be less than or equal to 1"),
])
def test_upcycle_settings_that_do_not_fit_the_layers_are_located(upcycle, field, message, tmp_path):
    text = (f"backbone: {SMALL}\ninput_size: {INPUT}\nmoe:\n  - {{where: {{every: 1}}, experts: 4, router: "
            f"{{kind: soft}}}}\nupcycle: {upcycle}\n")
    (tmp_path / "s.yaml").write_text(text)
    with pytest.raises(SpecError) as err:
        moespec.load_spec(tmp_path / "s.yaml")
    problem, = err.value.problems
    assert (problem.path, problem.line, problem.message) == (field, 5, message)


def test_cli_reports_unreadable_image_files_and_refuses_a_folder_of_none(dense_checkpoint, tmp_path):
    from PIL import Image

    (path, _) = dense_checkpoint(SMALL, name="a.safetensors")
    folder = tmp_path / "images"
    folder.mkdir()
    Image.new("RGB", (40, 40), (200, 30, 0)).save(folder / "a.png")
    for i in range(20):
        (folder / f"x{i:02d}.png").write_bytes(b"not a png")
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"backbone: {SMALL}\ninput_size: {INPUT}\nmoe:\n  - {{where: {{every: 1}}, experts: 4}}\n"
                    f"upcycle: {{router_init: kmeans}}\n")
    runner = CliRunner()
    args = ["upcycle", str(spec), str(path), "--images", str(folder), "-o", str(tmp_path / "out.safetensors")]
    for check in ("--check", "--no-check"):
        run = runner.invoke(app, [*args, check, "--force"])
        assert run.exit_code == 0, run.output
        assert (f"moespec: warning: upcycle: skipped 20 of 21 files in {folder} that are not readable images "
                f"(first: {folder / 'x00.png'}: cannot identify image file") in run.output
    (folder / "a.png").write_bytes(b"not a png either")
    run = runner.invoke(app, [*args[:-1], str(tmp_path / "none.safetensors")])
    assert run.exit_code == 2 and "Traceback" not in run.output
    assert run.output.strip() == (f"moespec: error: {folder}: no readable images (21 file(s) could not be read; "
                                  f"first: {folder / 'a.png'}: cannot identify image file '{folder / 'a.png'}')")
    assert not (tmp_path / "none.safetensors").exists()


def test_more_sources_than_experts_is_a_located_error_under_base_first(dense_checkpoint, tmp_path):
    """5 sources for 4 experts by the default i mod n: source 4 would give no expert and nothing else (base:
    first); an error naming the field and the counts, via the library and the CLI (exit 2). Sources that
    experts_from leaves out were chosen so; under base: average source 4 goes into the base's mean, which changes
    the weights."""
    paths = [dense_checkpoint(SMALL, name=f"{i}.safetensors", seed=i)[0] for i in range(5)]
    moe = [{"where": {"every": 1}, "experts": 4, "router": {"top_k": 1, "normalize": True}}]
    with pytest.raises(SpecError) as err:
        moespec.upcycle(spec_of(moe), paths)
    problem, = err.value.problems
    assert problem.path == "moe.0.experts"
    assert problem.message.startswith("5 sources for 4 experts: expert i takes source i mod 5, so source 4 would "
                                      "give no expert")
    named = moespec.upcycle(spec_of(moe, experts_from=[0, 1, 1, 0]), paths[:3]).state_dict()  # chosen: fine
    assert torch.equal(named["blocks.0.mlp.experts.fc1.weight"][3], named["blocks.0.mlp.experts.fc1.weight"][0])
    assert len(moespec.upcycle(spec_of(moe), paths[:4]).state_dict()) > 0  # as many sources as experts: fine
    average = moespec.upcycle(spec_of(moe, base="average"), paths).state_dict()
    four = moespec.upcycle(spec_of(moe, base="average"), paths[:4]).state_dict()
    assert not torch.equal(average["blocks.0.attn.qkv.weight"], four["blocks.0.attn.qkv.weight"])

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"backbone: {SMALL}\ninput_size: {INPUT}\nmoe:\n  - {{where: {{every: 1}}, experts: 4}}\n")
    run = CliRunner().invoke(app, ["upcycle", str(spec), *map(str, paths), "-o", str(tmp_path / "out.safetensors")])
    assert run.exit_code == 2 and "Traceback" not in run.output
    column = spec.read_text().splitlines()[3].index("experts") + 1  # the group's `experts:` key
    assert run.output.strip().startswith(f"moespec: error: {spec}:4:{column}: moe.0.experts: 5 sources for 4 experts: ")
    assert "so source 4 would give no expert" in run.output and not (tmp_path / "out.safetensors").exists()

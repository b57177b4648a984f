"""Per-rank figures under expert parallelism (moespec.counting.ranks) against hand calculations, and the
`--ranks` option of `moespec stats` and `moespec plan`."""

from __future__ import annotations

import csv
import io
import json

import pytest
from typer.testing import CliRunner

import moespec
from moespec.cli import app
from moespec.counting import RankStats, per_rank

from ..conftest import SPECS_DIR, TINY_SPEC_YAML, TINY_VIT, make_spec, write

# The tiny ViT of conftest: ViT-S/16 dims (C = 384, Mlp hidden H = 1536), 2 blocks, 64 px (4 x 4 patches), 10 classes.
C, H, DEPTH, TOKENS, CLASSES = 384, 1536, 2, 4 * 4 + 1, 10
MLP = (C * H + H) + (H * C + C)  # fc1 + fc2: one expert of an upcycled Mlp
BLOCK = 2 * 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + MLP  # 2 LayerNorms, qkv, proj, mlp
DENSE = (3 * 16 * 16 * C + C) + C + TOKENS * C + DEPTH * BLOCK + 2 * C + (C * CLASSES + CLASSES)
TOP2 = {"where": {"every": 1}, "experts": 4, "top_k": 2}


@pytest.fixture(scope="module")
def tiny_stats():
    """Both blocks' Mlp -> 4 experts, top-2: per layer a router (C x 4) and 4 experts."""
    return moespec.stats(make_spec(TINY_VIT, [TOP2]))


def test_the_tiny_spec_is_what_the_hand_calculation_assumes(tiny_stats):
    assert tiny_stats.dense_params == DENSE == 3_855_754
    assert tiny_stats.total_params == DENSE + DEPTH * (4 * MLP + C * 4 - MLP)
    assert [layer.routed_params for layer in tiny_stats.layers] == [4 * MLP] * DEPTH


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_tiny_per_rank_figures_match_a_hand_calculation(tiny_stats, ranks):
    experts_per_rank = DEPTH * (4 // ranks) * MLP  # each rank holds 4 / W experts of each of the 2 layers
    replicated = DENSE - DEPTH * MLP + DEPTH * C * 4  # the backbone without its Mlps, plus the routers
    params = experts_per_rank + replicated
    assert per_rank(tiny_stats, ranks) == RankStats(
        ranks=ranks, expert_params_per_rank=experts_per_rank, replicated_params=replicated, params_per_rank=params,
        train_bytes_per_rank=(4 + 4 + 4 + 4) * params)  # fp32 weight, grad, exp_avg, exp_avg_sq
    assert params == {1: 10_948_234, 2: 6_221_962, 4: 3_858_826}[ranks]


def test_one_rank_holds_the_whole_model(tiny_stats):
    one = per_rank(tiny_stats, 1)
    assert one.params_per_rank == tiny_stats.total_params and one.train_bytes_per_rank == 16 * tiny_stats.total_params


def test_shared_experts_and_soft_moe_parameters_are_replicated():
    shared = moespec.stats(make_spec(TINY_VIT, [{**TOP2, "shared_experts": 1}]))
    soft = moespec.stats(make_spec(TINY_VIT, [{"where": {"every": 1}, "experts": 4,
                                               "router": {"kind": "soft", "slots_per_expert": 2}}]))
    base = DENSE - DEPTH * MLP  # the backbone without its Mlps
    assert per_rank(shared, 2).replicated_params == base + DEPTH * (C * 4 + MLP)  # router + one shared expert
    assert per_rank(soft, 2).replicated_params == base + DEPTH * (C * 4 * 2 + 1)  # phi (C x 8 slots) + scale
    assert per_rank(shared, 2).expert_params_per_rank == per_rank(soft, 2).expert_params_per_rank == DEPTH * 2 * MLP


def test_a_dense_spec_is_all_replicated_on_any_number_of_ranks():
    dense = moespec.stats(make_spec(TINY_VIT, []))
    assert per_rank(dense, 3) == RankStats(3, 0, DENSE, DENSE, 16 * DENSE)


def test_experts_that_do_not_split_evenly_name_the_layers_and_the_ranks_that_work():
    mixed = moespec.stats(make_spec(TINY_VIT, [{"where": {"first": 1}, "experts": 4, "top_k": 1},
                                               {"where": {"last": 1}, "experts": 6, "top_k": 1}]))
    with pytest.raises(moespec.SpecError) as error:
        per_rank(mixed, 4)
    assert str(error.value) == ("4 ranks do not split the experts evenly: blocks.1.mlp has 6 experts; the number of "
                                "ranks must divide every MoE layer's experts: 1, 2")
    with pytest.raises(moespec.SpecError, match="blocks.0.mlp has 4 experts; blocks.1.mlp has 6 experts;"):
        per_rank(mixed, 5)
    assert per_rank(mixed, 2).expert_params_per_rank == (2 + 3) * MLP


def test_many_uneven_layers_stay_on_one_line():
    record = moespec.stats(make_spec({**TINY_VIT, "kwargs": {**TINY_VIT["kwargs"], "depth": 5}}, [TOP2]))
    with pytest.raises(moespec.SpecError) as error:
        per_rank(record, 3)
    assert ("blocks.0.mlp, blocks.1.mlp, blocks.2.mlp and 2 more have 4 experts; the number of ranks must divide "
            "every MoE layer's experts: 1, 2, 4") in str(error.value)
    assert "\n" not in str(error.value)


# The command line, in process.

def _invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_stats_ranks_adds_the_per_rank_columns(tmp_path):
    spec = write(tmp_path, TINY_SPEC_YAML)
    result = _invoke("stats", str(spec), "--ranks", "2", "-f", "csv")
    assert result.exit_code == 0, result.output
    header, row = list(csv.reader(io.StringIO(result.stdout)))
    assert header[-5:] == ["ranks", "params/rank (M)", "experts/rank (M)", "replicated (M)", "fp32 train GB/rank"]
    # 2 * 2 * MLP = 4,726,272 expert params and 1,495,690 replicated on each rank; 16 B x 6,221,962 = 0.0996 GB
    assert row[-5:] == ["2", "6.22", "4.73", "1.50", "0.10"]
    (record,) = json.loads(_invoke("stats", str(spec), "--ranks", "4", "-f", "json").stdout)
    assert record["per_rank"] == {"ranks": 4, "expert_params_per_rank": 2 * MLP, "replicated_params": 1_495_690,
                                  "params_per_rank": 2 * MLP + 1_495_690,
                                  "train_bytes_per_rank": 16 * (2 * MLP + 1_495_690)}
    markdown = _invoke("stats", str(spec), "--ranks", "2", "-f", "markdown").stdout
    assert "activations not included" in markdown and "16 bytes per parameter" in markdown


def test_stats_ranks_mistakes_are_one_clear_error(tmp_path):
    spec = write(tmp_path, TINY_SPEC_YAML)
    uneven = _invoke("stats", str(spec), "--ranks", "3")
    assert uneven.exit_code == 2 and uneven.stdout == ""
    assert uneven.stderr == (f"moespec: error: {spec}: 3 ranks do not split the experts evenly: blocks.0.mlp and "
                             "blocks.1.mlp have 4 experts; the number of ranks must divide every MoE layer's experts: "
                             "1, 2, 4\n")
    zero = _invoke("stats", str(spec), "--ranks", "0")
    assert zero.exit_code == 2 and "--ranks" in zero.stderr and "Traceback" not in zero.output
    both = _invoke("stats", str(spec), "--ranks", "2", "--per-layer")
    assert both.exit_code == 2
    assert both.stderr == "moespec: error: --ranks adds per-spec columns; it does not combine with --per-layer\n"


def test_plan_ranks_prints_the_per_rank_figures_after_the_plan(tmp_path):
    spec = write(tmp_path, TINY_SPEC_YAML)
    result = _invoke("plan", str(spec), "--ranks", "4")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[-2] == (f"per rank, expert parallelism over 4 ranks: {2 * MLP + 1_495_690:,} params = {2 * MLP:,} "
                         "in experts (1/4 of each MoE layer's) + 1,495,690 replicated (backbone, routers, shared "
                         "experts)")
    assert lines[-1].startswith("fp32 training memory per rank: 0.06 GB (16 bytes per parameter")
    assert lines[-1].endswith("activations not included)")
    assert "blocks.1.mlp" in result.stdout  # the plan comes first
    assert "per rank" not in _invoke("plan", str(spec)).stdout


# Soft MoE L/16 (Puigcerver et al.): does it train on 80 GB GPUs, and on how many?

L16_C, L16_H = 1024, 4096
L16_EXPERT = 2 * L16_C * L16_H + L16_H + L16_C  # fc1 + fc2 of ViT-L/16's Mlp: 8,393,728
L16_BLOCK = 2 * 2 * L16_C + (L16_C * 3 * L16_C + 3 * L16_C) + (L16_C * L16_C + L16_C) + L16_EXPERT
L16_DENSE = (3 * 16 * 16 * L16_C + L16_C) + L16_C + 197 * L16_C + 24 * L16_BLOCK + 2 * L16_C + (L16_C * 1000 + 1000)


@pytest.mark.slow  # builds and traces ViT-L/16 (about 30 s)
def test_softmoe_l16_per_rank_memory_against_a_hand_calculation():
    s = moespec.stats(moespec.load_spec(SPECS_DIR / "softmoe_l16_e128_half.yaml"))
    assert s.dense_params == L16_DENSE == 304_326_632
    routed = 12 * 128 * L16_EXPERT  # the last 12 blocks, 128 experts each
    assert routed == 12_892_766_208 and sum(layer.routed_params for layer in s.layers) == routed
    replicated = L16_DENSE - 12 * L16_EXPERT + 12 * (L16_C * 128 + 1)  # phi: C x 128 slots, and a scale
    assert replicated == 205_174_772
    expected = {1: 209_567_055_680, 2: 106_424_926_016, 4: 54_853_861_184, 8: 29_068_328_768}
    for ranks, train_bytes in expected.items():
        r = per_rank(s, ranks)
        assert r.expert_params_per_rank == routed // ranks and r.replicated_params == replicated
        assert r.train_bytes_per_rank == 16 * (routed // ranks + replicated) == train_bytes
        print(f"W={ranks}: {r.params_per_rank:,} params/rank, {r.train_bytes_per_rank / 1e9:.2f} GB/rank")
    assert per_rank(s, 8).train_bytes_per_rank < 80e9 < per_rank(s, 2).train_bytes_per_rank
    with pytest.raises(moespec.SpecError, match="must divide every MoE layer's experts: 1, 2, 4, 8, 16, 32, 64, 128"):
        per_rank(s, 3)

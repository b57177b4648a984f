"""The reproduction page (docs/reproduction.md, written by tools/reproduction.py): every row of the seeds' tables
(tools/seed_rows.json) is on it, the page is what the tool prints from the specs, every figure moespec does not
match names a note, and the notes' hand calculations hold."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("moespec_reproduction_tool", ROOT / "tools" / "reproduction.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def test_the_seed_rows_are_all_there(tool):
    rows = tool.seed_rows()
    assert len(rows) == 295 and sorted(r["id"] for r in rows) == list(range(1, 296))
    assert {r["seed"][:3] for r in rows} == {"001", "002", "003", "004"}


def test_every_row_names_a_spec_that_exists_and_a_note_that_is_written(tool):
    notes = set(re.findall(r"\*\*\[(\w)\]\*\*", tool.NOTES))
    hows = [tool.row_of(row) for row in tool.seed_rows()]
    used = {how.note for how in hows if how is not None and how.note}
    assert used == notes, (used - notes, notes - used)
    for how in hows:
        if how is None:
            continue
        assert (how.spec is None) == bool(how.why), how
        if how.spec:
            assert tool.spec_path(how.spec).is_file(), how.spec
    missing = [row["id"] for row, how in zip(tool.seed_rows(), hows, strict=True) if how is None]
    assert not missing, missing


@pytest.mark.parametrize("ours, printed, agree", [
    (34.500040, "34.5", True),
    (22.050664, "22.0", True),  # truncated to the printed digit
    (117.167560, "117.1", True),  # truncated
    (29.158504, "33.1", False),
    (922.7, "933M", False),  # 1.1% under
    (1830.39, "1.8B", True),
    (4.61, "4.2G", False),
    (4.47, "4.5G", True),
])
def test_a_figure_agrees_within_one_percent_or_as_printed(tool, ours, printed, agree):
    assert tool.agrees(ours, printed) is agree


def test_a_tolerance_widens_the_agreement(tool):
    assert not tool.agrees(70.7, "69", 0.01) and tool.agrees(70.7, "69", 0.05)  # Sparse-B, seed 002: +2.5%


def test_printed_cells_are_read_as_the_figure_they_state(tool):
    assert tool.printed_figure("71.7 (printed '71.7.6')") == "71.7"
    assert tool.printed_figure("62.8% of 207 = 130") == "130"
    assert tool.printed_figure("-") == tool.printed_figure("") == ""


def test_figures_are_shown_one_digit_finer_than_the_paper_prints_them(tool):
    assert tool.show(1830.393454, "1.8B") == "1.83B"
    assert tool.show(922.7, "933M") == "922.7M"
    assert tool.show(4.2401, "4.2G") == "4.24G"
    assert tool.show(97.341352, "97.5") == "97.34"


@pytest.mark.slow  # counts every row: some 150 specs up to ViT-H/14 and ViT-g/14, many minutes
def test_the_page_is_what_the_tool_prints(tool, capsys):
    assert tool.main(["--check"]) == 0, capsys.readouterr().err


@pytest.mark.slow
def test_the_notes_hand_calculations(tool):
    """Each figure here is the notes' arithmetic, done by hand from the layer shapes; moespec must agree to the
    parameter."""
    def params(spec, *sets):
        s = tool.count(spec, tuple(sets))
        return s.total_params, s.activated_params

    ratio_2 = tool.RATIO_2
    # [s]: Last 3 and Stage at mlp_ratio 4, 8 experts.
    assert params("convnext_t_moe8_last3_top1")[0] == 69_926_344 + 7 * 1_181_568 + 3_072 == 78_200_392
    stage = 28_589_128 + sum(7 * (8 * d * d + 5 * d) + 8 * d for d in (96, 192, 384, 768))
    assert params("convnext_t_moe8_stage_top1")[0] == stage == 72_519_208
    # [n]: Last 2 with E experts at mlp_ratio 2.
    for experts in (4, 8, 16):
        spec = "convnext_t_moe4_last2_top1" if experts == 4 else "convnext_t_moe8_last2_top1"
        sets = () if experts == 4 else (ratio_2, f"moe.0.experts={experts}")
        total = 28_589_128 - 5_904_000 + experts * (2_952_576 + 1_152)
        assert params(spec, *sets)[0] == total
    # [l]: ViT-S Last 2 top-2 activates the same whatever the number of experts, bar the router rows.
    for experts in (4, 8, 16):
        activated = params("vit_s16_moe8_last2_top2", f"moe.0.experts={experts}")[1]
        assert activated == 22_050_664 + 2 * (1_181_568 + 384 * experts)
    # [x]: Table 6's formula.
    for experts, total in ((8, 69_926_344), (16, 117_167_560), (32, 211_649_992)):
        assert params("convnext_t_moe8_last2_top1", f"moe.0.experts={experts}")[0] == total
        assert total == 28_589_128 + (experts - 1) * 5_904_000 + 1_152 * experts
    # [m]: Sparse-S, with and without its rescale sub-layers.
    sparse_block = 4 * (392 * 512 * 2 + 512 + 392) + 392 * 4 + 2_099_712 + 2_048 + 679_564
    assert sparse_block == 4_392_140
    total = 393_728 + 6 * 2_202_564 + 2 * sparse_block + 1_024 + 513_000
    assert params("sparse_mlp_s")[0] == total == 22_907_416
    assert 77_224 + 77_028 + 2 * 262_656 == 679_564 and total - 2 * 679_564 == 21_548_288


@pytest.fixture(scope="module")
def throughput(tool):
    spec = importlib.util.spec_from_file_location("moespec_throughput_tool", ROOT / "tools" / "throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_moe_row_with_a_throughput_is_measured_or_says_why_not(tool, throughput):
    """Each MoE row of the seeds' throughput columns names its dense row, and either its spec was benched
    (tools/throughput.json holds it) or the row says why not."""
    rows = {row["id"]: row for row in tool.seed_rows()}
    measured = json.loads(throughput.RESULTS.read_text())
    assert set(throughput.DENSE_OF) <= set(throughput.PRINTED) and set(throughput.PRINTED) <= set(rows)
    for moe, dense in throughput.DENSE_OF.items():
        assert rows[moe]["seed"] == rows[dense]["seed"] and rows[moe]["table"] == rows[dense]["table"]
        spec = tool.row_of(rows[moe]).spec
        assert (spec in measured) != (moe in throughput.NOT_MEASURED), (moe, spec)
    assert set(measured) == set(throughput.MEASURED)


def test_the_paper_ratio_is_moe_over_dense_throughput(throughput):
    assert throughput.paper_ratio(13, "001") == pytest.approx(724 / 1083)
    assert throughput.paper_ratio(171, "004") == pytest.approx(0.5 / 0.7)  # ms/img: dense ms over MoE ms
    assert throughput.paper_ratio(11, "001") is None  # a dense row


def test_the_throughput_section_is_what_the_tool_writes(tool):
    """The page's last section is what tools/reproduction.py renders from tools/throughput.json (the rest of the
    page, the counts, is checked by the slow test above)."""
    page = tool.PAGE.read_text()
    assert tool.with_throughput(page) == page
    assert page.endswith(tool.throughput_section() + "\n")

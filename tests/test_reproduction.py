"""The README's reproduction table (tools/reproduction.py): the copy in the README is what the tool prints from
the specs, every figure moespec does not match names a note, and the notes' hand calculations hold."""

import importlib.util
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


def test_every_row_names_a_spec_that_exists_and_a_note_that_is_written(tool):
    notes = set(re.findall(r"\*\*\[(\w)\]\*\*", tool.NOTES))
    used = {row.note for row in tool.ROWS if row.note}
    assert used == notes, (used - notes, notes - used)
    for row in tool.ROWS:
        assert (row.spec is None) == bool(row.why), row
        if row.spec:
            assert (ROOT / "specs" / f"{row.spec}.yaml").is_file(), row.spec
    seeds = {row.seed for row in tool.ROWS}
    assert seeds == {"001", "002", "003", "004"}


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


def test_figures_are_shown_one_digit_finer_than_the_paper_prints_them(tool):
    assert tool.show(1830.393454, "1.8B") == "1.83B"
    assert tool.show(922.7, "933M") == "922.7M"
    assert tool.show(4.2401, "4.2G") == "4.24G"
    assert tool.show(97.341352, "97.5") == "97.34"


@pytest.mark.slow
def test_the_readme_copy_is_what_the_tool_prints(tool, capsys):
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
    assert params("convnext_t_moe8_last2_top1", ratio_2, "moe.0.router.top_k=2")[1] == (
        28_589_128 - 5_904_000 + 2 * 2_952_576 + 8 * 1_152)
    # [l]: ViT-S Last 2 top-2 activates the same whatever the number of experts, bar the router rows.
    for experts in (4, 8, 16):
        activated = params("vit_s16_moe8_last2_top2", f"moe.0.experts={experts}")[1]
        assert activated == 22_050_664 + 2 * (1_181_568 + 384 * experts)
    # [x]: Table 6's formula.
    for experts, total in ((8, 69_926_344), (16, 117_167_560), (32, 211_649_992)):
        assert params("convnext_t_moe8_last2_top1", f"moe.0.experts={experts}")[0] == total
        assert total == 28_589_128 + (experts - 1) * 5_904_000 + 1_152 * experts

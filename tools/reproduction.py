"""The seeds' published parameter and FLOP figures, every row of `tools/seed_rows.json`, each next to what
`moespec stats` counts for the same model: the page docs/reproduction.md.

    python tools/reproduction.py            # print the page (markdown)
    python tools/reproduction.py --write    # write docs/reproduction.md
    python tools/reproduction.py --check    # exit 1 if docs/reproduction.md differs from what this prints
    python tools/reproduction.py --throughput   # rewrite only its Throughput section (tools/throughput.py)

`tools/seed_rows.json` lists the 295 rows of the four seed papers that print a parameter, activated-parameter or
FLOP figure: seed, table, row, configuration, the figures as printed and their unit. Each row here names the spec
that encodes it (a file under `specs/`, or `tools/seed_specs/` for the seeds' own models, changed by
`--set PATH=VALUE` settings where the paper's variant is not shipped: the settings `moespec sweep` takes) and
the counting conventions of `stats` it needs, or says why no spec can be written. A dense row counts the spec's
backbone before the MoE surgery. A figure outside its tolerance (below) is marked with a cross, and the row
names the note that explains it with the arithmetic.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import moespec  # noqa: E402
from moespec.apps.sweep import assign, base_document, parse_setting  # noqa: E402

SPECS = ROOT / "specs"
SEED_SPECS = Path(__file__).resolve().parent / "seed_specs"  # reproduction-only specs: `seeds/NAME` in a row
PAGE = ROOT / "docs" / "reproduction.md"
SEED_ROWS = Path(__file__).resolve().parent / "seed_rows.json"

# Parameter tolerances per seed (the seeds' own rounding and their stated model variants), FLOPs 2.5%.
PARAMS_TOLERANCE = {"001": 0.01, "002": 0.05, "003": 0.02, "004": 0.03}
FLOPS_TOLERANCE = 0.025
TRAIN_STEPS_IMAGES = 300_000 * 4096  # seed 004 Table 9: 300k steps of 4096 images


@dataclass(frozen=True)
class Row:
    """How moespec counts one row of seed_rows.json (by its id)."""

    spec: str | None = None  # a spec under specs/ (its path without .yaml); None where none can be written
    sets: tuple[str, ...] = ()  # `--set PATH=VALUE` changes to the spec
    dense: bool = False  # count the spec's backbone before the surgery
    note: str = ""  # the note that explains a figure moespec does not match
    why: str = ""  # for a row without a spec
    attention: str = "count"  # `stats --attention-matmuls`
    dispatch: str = "gather"  # `stats --dispatch-flops`
    over_dense: bool = False  # the figure is the activated parameters less the dense backbone's


def seed_rows() -> list[dict]:
    return json.loads(SEED_ROWS.read_text())


# --- the specs of each row ------------------------------------------------------------------------------------
CT, CS, CB = "convnext_t_dense", "convnext_s_moe4_last2_top1", "convnext_b_moe4_last2_top1"
CT4, CT8, CT8E = "convnext_t_moe4_last2_top1", "convnext_t_moe8_last2_top1", "convnext_t_moe8_every2_top1"
CT8S, CT8L3 = "convnext_t_moe8_stage_top1", "convnext_t_moe8_last3_top1"
VS, VSE, VSL, VB = "vit_s16_dense", "vit_s16_moe8_every2_top2", "vit_s16_moe8_last2_top2", "vit_b16_moe8_every2_top2"
VL = "softmoe_l16_e128_half"  # its backbone is ViT-L/16 with 1000 classes
RATIO_2 = "moe.0.expert_mlp_ratio=2"  # seed 001's ImageNet-1k ConvNeXt experts (Table 1's caption)
E8_RATIO_4 = ("moe.0.experts=8", "moe.0.expert_mlp_ratio=4")
NO_ISOTROPIC = "not a timm model: timm's ConvNeXt has four stages"
JFT300 = 18_291  # V-MoE's JFT-300M classes
DINO = "dinov2_s14_image_e8_last2"
SWIN, SWIN_B = "seeds/swinv2_s_moe8_every2_top1", ("backbone.model=swinv2_base_window16_256",)


def _kwargs(**kwargs) -> str:
    return "backbone.kwargs={" + ", ".join(f"{k}: {v}" for k, v in kwargs.items()) + "}"


def _vimoe(n: int, layers: int, shared: bool) -> str:
    return f"dinov2_s14_image_e{n}_{'all' if layers == 12 else f'last{layers}'}{'_shared' if shared else ''}"


ROWS: dict[int, Row] = {
    # Seed 001, Table 1 (ImageNet-1k: ConvNeXt experts at mlp_ratio 2).
    1: Row(CT), 2: Row(CT4), 3: Row(CS, dense=True), 4: Row(CS), 5: Row(CB, dense=True), 6: Row(CB),
    **{i: Row(why=NO_ISOTROPIC, note="i") for i in (7, 8, 9, 10, 31, 32, 33)},
    11: Row(VS), 12: Row(VSL, note="l"), 13: Row(VSE, note="b"), 14: Row(VB, dense=True), 15: Row(VB, note="b"),
    # Table 2 (ImageNet-21k: experts at mlp_ratio 4).
    16: Row(CT), 17: Row(CT8), 18: Row(CS, dense=True), 19: Row(CS, E8_RATIO_4), 20: Row(CB, dense=True),
    21: Row(CB, E8_RATIO_4), 22: Row(VS), 23: Row(VSE, note="b"), 24: Row(VB, dense=True), 25: Row(VB, note="b"),
    # Table 3 (placements, ImageNet-1k, mlp_ratio 2).
    26: Row(CT), 27: Row(CT8E, (RATIO_2,), note="e"), 28: Row(CT8S, (RATIO_2,)), 29: Row(CT8L3, (RATIO_2,)),
    30: Row(CT8, (RATIO_2,)), 34: Row(VS, attention="skip"), 35: Row(VSE, note="b"), 36: Row(VSL, note="l"),
    # Table 4 (numbers of experts, Last 2).
    37: Row(CT), 38: Row(CT4, note="n"), 39: Row(CT8, (RATIO_2,), note="n"),
    40: Row(CT8, (RATIO_2, "moe.0.experts=16"), note="n"), 41: Row(VS), 42: Row(VSL, ("moe.0.experts=4",), note="l"),
    43: Row(VSL, note="l"), 44: Row(VSL, ("moe.0.experts=16",), note="l"),
    # Tables 5 and 6 (ImageNet-21k, ConvNeXt-T, 8 experts at mlp_ratio 4 unless set).
    45: Row(CT), 46: Row(CT8E), 47: Row(CT8S, note="s"), 48: Row(CT8L3, note="s"), 49: Row(CT8),
    50: Row(CT8, (RATIO_2,)), 51: Row(CT), 52: Row(CT8, note="x"), 53: Row(CT8, ("moe.0.experts=16",)),
    54: Row(CT8, ("moe.0.experts=32",)),
    # Table 13 (data augmentation) and Table 14 (MoE against dense models, with their sources' figures).
    55: Row(VB, dense=True), 56: Row(VB, note="b"), 57: Row(VB, dense=True), 58: Row(VB, note="b"),
    59: Row(VS, (_kwargs(patch_size=32, embed_dim=512, depth=8, num_heads=8, num_classes=JFT300),)),
    60: Row(VSL, (_kwargs(patch_size=32, embed_dim=512, depth=8, num_heads=8, num_classes=JFT300),
                  "moe.0.experts=32")),
    61: Row(VSE, (_kwargs(patch_size=32, embed_dim=512, depth=8, num_heads=8, num_classes=JFT300),
                  "moe.0.experts=32")),
    62: Row(VS), 63: Row(VSE, note="b"), 64: Row(CT), 65: Row(CT8),
    66: Row(SWIN, dense=True), 67: Row(SWIN), 68: Row(SWIN, ("moe.0.experts=16",)),
    69: Row(SWIN, ("moe.0.experts=32",), note="w"), 79: Row(SWIN, SWIN_B, dense=True), 80: Row(SWIN, SWIN_B),
    81: Row(SWIN, (*SWIN_B, "moe.0.experts=16")), 82: Row(SWIN, (*SWIN_B, "moe.0.experts=32")),
    70: Row(CS, dense=True), 71: Row(CS, E8_RATIO_4), 72: Row(VB, dense=True), 73: Row(VB, note="b"),
    74: Row(VB, dense=True), 75: Row(VB, dense=True), 76: Row(VB, (_kwargs(num_classes=JFT300),), dense=True),
    77: Row(VB, (_kwargs(num_classes=JFT300), "moe.0.experts=32")),
    78: Row(VB, (_kwargs(num_classes=JFT300), "moe.0.experts=32", "moe.0.where={last: 2}")),
    83: Row(CB, dense=True), 84: Row(CB, E8_RATIO_4), 85: Row(VL, dense=True),
    86: Row(VL, (_kwargs(num_classes=JFT300),), dense=True), 87: Row(VL, (_kwargs(num_classes=JFT300),), dense=True),
    88: Row(VL, (_kwargs(num_classes=JFT300), "moe.0.where={every: 2}",
                 "moe.0.router={kind: topk, top_k: 2}", "moe.0.experts=32")),
    89: Row(VL, (_kwargs(num_classes=JFT300), "moe.0.where={last: 2}",
                 "moe.0.router={kind: topk, top_k: 2}", "moe.0.experts=32")),
    90: Row(VS, ("backbone.model=vit_so400m_patch14_siglip_224", _kwargs(num_classes=0)), dense=True, note="o"),
    91: Row(VS, ("backbone.model=vit_giant_patch14_224", _kwargs(num_classes=0)), dense=True, note="o"),
    92: Row(why="the seed gives no configuration of V-MoE 15B", note="o"),
    # Seed 002 (Sparse-MLP), Tables 1, 5 and 8 and its text.
    93: Row(VB, dense=True), 94: Row(VL, dense=True), 95: Row("sparse_mlp_s", dense=True),
    96: Row("sparse_mlp_b", dense=True),
    97: Row("sparse_mlp_l", ("backbone.model=mixer_l16_224", _kwargs(num_classes=1000)), dense=True),
    98: Row("sparse_mlp_s", note="m"),
    99: Row("sparse_mlp_b"), 100: Row("sparse_mlp_l"), 101: Row("sparse_mlp_b", dense=True), 102: Row("sparse_mlp_b"),
    103: Row("sparse_mlp_b", ("rescale.where={first: 2}", "moe.0.where={first: 2}", "moe.1.where={first: 2}")),
    104: Row("sparse_mlp_b", ("rescale.where={last: 4}", "moe.0.where={last: 4}", "moe.1.where={last: 4}")),
    105: Row("sparse_mlp_s"), 106: Row("sparse_mlp_b"), 107: Row("sparse_mlp_l"), 108: Row("sparse_mlp_b"),
    109: Row("sparse_mlp_l"),
    # Seed 003 (ViMoE), Table 1: DINOv2-S/14 at 224, image routing, top-1 on [CLS].
    110: Row(DINO, dense=True),
    **{i: Row(_vimoe(n, layers, shared)) for i, (n, layers, shared) in zip(range(111, 120), (
        (2, 5, False), (2, 5, True), (2, 12, True), (4, 3, False), (4, 3, True), (4, 12, True), (8, 2, False),
        (8, 2, True), (8, 12, True)), strict=True)},
    # Table 3: dense backbones (the /16 rows' FLOPs without attention's two products) and ViMoE.
    **{i: Row(VS, attention="skip") for i in (120, 121, 122, 123)}, 124: Row(DINO, dense=True),
    **{i: Row(VB, dense=True) for i in (125, 126, 127, 128, 129)},
    130: Row(DINO, ("backbone.model=vit_base_patch14_dinov2",), dense=True),
    **{i: Row(VL, dense=True, attention="skip") for i in (131, 132, 133, 134)},
    135: Row(DINO), 136: Row(_vimoe(8, 2, True)),
    137: Row(_vimoe(8, 2, True), ("backbone.model=vit_base_patch14_dinov2",)),
    **{i: Row(why="UPerNet is a decoder, not a timm model", note="u") for i in range(138, 144)},
    144: Row(DINO, (_kwargs(img_size=518, dynamic_img_pad="true", num_classes=150), "input_size=[3, 512, 512]"),
             dense=True),
    145: Row(_vimoe(8, 2, True), (_kwargs(img_size=518, dynamic_img_pad="true", num_classes=150),
                                  "input_size=[3, 512, 512]", "moe.0.where={last: 1}",
                                  "moe.0.router={kind: topk, top_k: 1}"), note="k"),
    **{i: Row(why="per-image activation of a trained model's token routing (`moespec inspect`)", note="t")
       for i in (146, 147, 148, 149)},
    150: Row(_vimoe(8, 2, True)), 151: Row(_vimoe(4, 3, True)), 152: Row(_vimoe(2, 5, True)),
    153: Row(DINO, dense=True),
    **{i: Row(_vimoe(2, 5, False), (f"moe.0.where={{last: {layers}}}", "moe.0.router={kind: image, top_k: 2}"))
       for i, layers in zip((154, 155, 156, 157), (2, 3, 5, 12), strict=True)},
    158: Row(_vimoe(8, 2, True)), 159: Row(_vimoe(4, 3, True)), 160: Row(_vimoe(2, 5, True)),
    161: Row(_vimoe(8, 2, True), over_dense=True),
}
JFT = {"S/16 128E": "seeds/softmoe_s16_e128_half_jft", "S/14 256E": "seeds/softmoe_s14_e256_half_jft",
       "B/16 128E": "seeds/softmoe_b16_e128_half_jft", "L/16 128E": "seeds/softmoe_l16_e128_half_jft",
       "H/14 128E": "seeds/softmoe_h14_e128_half_jft", "H/14 256E": "seeds/softmoe_h14_e256_half_jft"}
JFT_DENSE = {"S/16": JFT["S/16 128E"], "B/16": JFT["B/16 128E"], "L/16": JFT["L/16 128E"], "H/14": JFT["H/14 128E"]}


def _soft_moe_row(row: dict) -> Row:
    """Seed 004, Tables 1 and 8 and Section 3.4: the paper's models, JFT head and pooling (tools/seed_specs/)."""
    name = row["row"]
    for key, spec in JFT.items():
        if f"Soft MoE {key}" in name or (row["id"] == 188 and key == "B/16 128E"):
            return Row(spec)
    for key, spec in JFT_DENSE.items():
        if f"ViT {key}" in name:
            return Row(spec, dense=True)
    if row["id"] == 187:
        return Row(JFT["S/16 128E"], note="r")
    raise KeyError(name)


TABLE_9_BASE = {"S": JFT["S/16 128E"], "B": JFT["B/16 128E"], "L": JFT["L/16 128E"], "H": JFT["H/14 128E"]}
TABLE_9 = re.compile(r"(?P<size>[SBLH])/(?P<patch>\d+) (?:(?P<dense>Dense)|"
                     r"(?P<kind>Soft MoE|Experts Choice|Tokens Choice) (?P<experts>\d+)E"
                     r"(?: K=(?P<k>\d+))?(?: C=(?P<c>[\d.]+))? G=(?P<group>\d+))")


def _table_9_row(row: dict) -> Row:
    """Seed 004, Table 9: training exaFLOP of 300k-step runs, counted with `--dispatch-flops einsum` on the paper's
    model (`tools/seed_specs/`, its patch size set), MoE in the last half of the blocks as in the base spec."""
    match = TABLE_9.search(row["row"])
    size, patch = match["size"], int(match["patch"])
    sets = [_kwargs(patch_size=patch, num_classes=29000, class_token="false", global_pool="avg")]
    if match["dense"]:
        return Row(TABLE_9_BASE[size], tuple(sets), dense=True, dispatch="einsum", note=NOTE_9.get(row["id"], ""))
    tokens = (224 // patch) ** 2
    images = int(match["group"]) // tokens  # the routing group, in images
    router = {"Soft MoE": "{kind: soft, slots_per_expert: 1}",
              "Experts Choice": f"{{kind: expert_choice, capacity: {match['c']}, group: {images}}}",
              "Tokens Choice": f"{{kind: topk, top_k: {match['k']}, capacity_factor: {match['c']}, group: {images}}}",
              }[match["kind"]]
    sets += [f"moe.0.experts={match['experts']}", f"moe.0.router={router}"]
    note = NOTE_9.get(row["id"], "")
    if match["kind"] == "Tokens Choice":  # where moespec's capacity (ceil) and the paper's (round) differ
        per_expert = float(match["c"]) * int(match["k"]) * int(match["group"]) / int(match["experts"])
        note = note or ("c" if math.ceil(per_expert) != round(per_expert) else "")
    note = note or ("g" if images > 1 else "")  # a group of several images: the einsums grow with it
    return Row(TABLE_9_BASE[size], tuple(sets), dispatch="einsum", note=note)


NOTE_9: dict[int, str] = {205: "c", 289: "h", 290: "h"}  # Table 9 rows outside the tolerance -> their note


def row_of(row: dict) -> Row | None:
    """How moespec counts a seed row; None for a row not yet written here."""
    if row["id"] in ROWS:
        return ROWS[row["id"]]
    if row["seed"].startswith("004"):
        return _table_9_row(row) if row["table"] == "9" else _soft_moe_row(row)
    return None


# --- figures ----------------------------------------------------------------------------------------------------
def figure(printed: str) -> float:
    """A printed figure in its table's unit: millions for parameters ("933M", "1.8B", "34.5"), G for FLOPs."""
    text = printed.strip().rstrip("G").lstrip("+")
    if text.endswith("B"):
        return float(text[:-1]) * 1000
    return float(text.rstrip("M"))


def decimals(printed: str) -> int:
    text = printed.strip().rstrip("GMB")
    return len(text.split(".")[1]) if "." in text else 0


def agrees(ours: float, printed: str, tolerance: float = 0.01) -> bool:
    """Within `tolerance` of the paper's figure, or equal to it once rounded or truncated to the digits it
    prints."""
    paper, digits = figure(printed), decimals(printed)
    scale = 1000 if printed.strip().endswith("B") else 1
    shown = ours / scale
    if round(shown, digits) == paper / scale or math.floor(shown * 10**digits) / 10**digits == paper / scale:
        return True
    return abs(ours - paper) <= tolerance * paper


def show(ours: float, printed: str) -> str:
    """moespec's figure in the paper's unit, one digit finer than the paper prints it."""
    digits = decimals(printed) + 1
    printed = printed.strip()
    if printed.endswith("B"):
        return f"{ours / 1000:.{digits}f}B"
    suffix = "M" if printed.endswith("M") else ("G" if printed.endswith("G") else "")
    return f"{ours:.{digits}f}{suffix}"


def printed_figure(text: str) -> str:
    """The comparable part of a printed cell: '71.7 (printed '71.7.6')' -> '71.7'; '-' and '' -> ''."""
    text = text.strip().split("= ")[-1]  # "62.8% of 207 = 130": the figure it works out to
    if not text or text == "-" or text.startswith("B"):
        return ""
    return text.split(" ")[0]


def spec_path(spec: str) -> Path:
    """A row's spec file: `seeds/NAME` is tools/seed_specs/NAME.yaml (the seeds' own models, outside specs/ so
    that `moespec stats specs/` stays quick), any other name specs/NAME.yaml."""
    return SEED_SPECS / f"{spec[len('seeds/'):]}.yaml" if spec.startswith("seeds/") else SPECS / f"{spec}.yaml"


CACHE: dict[str, list[float]] = {}  # `--cache FILE`: counts by row setting, kept between runs (see `numbers`)
CACHE_FILE: Path | None = None


def numbers(spec: str, sets: tuple[str, ...], attention: str, dispatch: str) -> list[float]:
    """[total, activated, dense params, GMACs, dense GMACs] of a spec with settings, counted, or read from the
    `--cache` file, whose key holds the spec file's text (an edited spec is counted again)."""
    key = json.dumps([spec, spec_path(spec).read_text(), list(sets), attention, dispatch])
    if key not in CACHE:
        s = count(spec, sets, attention, dispatch)
        CACHE[key] = [s.total_params, s.activated_params, s.dense_params, s.gmacs, s.dense_gmacs]
        if CACHE_FILE is not None:
            write_text(CACHE_FILE, json.dumps(CACHE))
    return CACHE[key]


@lru_cache(maxsize=None)
def count(spec: str, sets: tuple[str, ...], attention: str = "count", dispatch: str = "gather") -> moespec.SpecStats:
    document = copy.deepcopy(base_document(spec_path(spec)))
    for text in sets:
        setting = parse_setting(text)
        (value,) = setting.values
        assign(document, setting, value)
    return moespec.stats(moespec.load_spec(document), attention_matmuls=attention, dispatch_flops=dispatch)


def flops_per_gmac(row: dict) -> float:
    """The seed's FLOP unit per moespec GMAC: seed 004 prints GFLOP (2 per MAC), and Table 9 training exaFLOP
    (3 x GMACs x 4096 x 300k, the factor its dense rows fit); the others print GMACs."""
    if not row["seed"].startswith("004"):
        return 1.0
    return 3 * TRAIN_STEPS_IMAGES / 1e9 if row["table"] == "9" else 2.0


def figures(row: dict, how: Row) -> tuple[float, float, float]:
    """moespec's total and activated parameters (M) and FLOPs in the seed's unit."""
    total, activated, dense, gmacs, dense_gmacs = numbers(how.spec, how.sets, how.attention, how.dispatch)
    unit = flops_per_gmac(row)
    if how.dense:
        return dense / 1e6, dense / 1e6, dense_gmacs * unit
    if how.over_dense:
        return total / 1e6, (activated - dense) / 1e6, gmacs * unit
    return total / 1e6, activated / 1e6, gmacs * unit


def cell(printed: str, ours: float | None, tolerance: float) -> tuple[str, bool]:
    """`paper / moespec`, with a cross where they differ, and whether they agree."""
    figure_text = printed_figure(printed)
    if ours is None or not figure_text:
        return f"{printed.strip() or '-'} / -", True
    ok = agrees(ours, figure_text, tolerance)
    return f"{printed.strip()} / {show(ours, figure_text)}{'' if ok else ' ✗'}", ok


def spec_cell(how: Row | None) -> str:
    if how is None:
        return "(not yet written)"
    if how.spec is None:
        return how.why
    options = "".join(f" `--{name} {value}`" for name, value, default in (
        ("attention-matmuls", how.attention, "count"), ("dispatch-flops", how.dispatch, "gather")) if value != default)
    text = f"`{how.spec}`" + "".join(f" `{s}`" for s in how.sets) + options
    return f"backbone of {text}" if how.dense else text


def table_lines(rows: list[dict]) -> tuple[list[str], list[int]]:
    """The table's lines, and the ids of the rows not yet written."""
    lines = ["| id | seed | table | row | spec (and `--set`, options) | params (M) | activated (M) | FLOPs | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    missing = []
    for row in rows:
        how = row_of(row)
        seed = row["seed"][:3]
        if how is None:
            missing.append(row["id"])
        ours = figures(row, how) if how is not None and how.spec else (None, None, None)
        tolerances = (PARAMS_TOLERANCE[seed], PARAMS_TOLERANCE[seed], FLOPS_TOLERANCE)
        printed = (row["published_params"], row["published_activated"], row["published_flops"])
        cells = [cell(*args) for args in zip(printed, ours, tolerances, strict=True)]
        wrong = not all(ok for _, ok in cells)
        if wrong and not (how and how.note):
            raise SystemExit(f"row {row['id']} ({row['row']}) disagrees and names no note: {cells}")
        name = row["row"].replace("|", "/")
        lines.append(f"| {row['id']} | {seed} | {row['table'].split(' (')[0]} | {name} | {spec_cell(how)} | "
                     + " | ".join(text for text, _ in cells) + f" | {how.note if how else ''} |")
    return lines, missing


def render() -> str:
    lines, missing = table_lines(seed_rows())
    status = (f"{len(missing)} of the {len(seed_rows())} rows are not written here yet: ids "
              f"{', '.join(map(str, missing))}." if missing else "Every row is written.")
    return "\n".join([HEADER.strip(), "", status, "", *lines, "", NOTES.strip(), "", throughput_section(), ""])


def throughput_section() -> str:
    """The page's last section: the seeds' throughput column beside `moespec bench` (tools/throughput.py, its
    measurements in tools/throughput.json)."""
    spec = importlib.util.spec_from_file_location("moespec_throughput_tool", Path(__file__).parent / "throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.section(seed_rows(), lambda row: (row_of(row) or Row()).spec)


THROUGHPUT_HEADING = "\n## Throughput\n"


def with_throughput(page: str) -> str:
    """`page` with its Throughput section (the end of the page) written afresh, the rows above as they are."""
    head = page.split(THROUGHPUT_HEADING, 1)[0].rstrip("\n")
    return f"{head}\n\n{throughput_section()}\n"


HEADER = """
# Reproduction: the seeds' tables, row by row

Every row of the four seed papers that prints a parameter, activated-parameter or FLOP figure
(`tools/seed_rows.json`), next to what `moespec stats` counts for the same model. Generated by
`python tools/reproduction.py --write`; `tests/test_reproduction.py` checks that this page is what the tool
prints and that the notes' hand calculations hold.

Figures are `paper / moespec`, moespec's one digit finer than the paper prints. A figure agrees when it rounds or
truncates to the paper's, or is within the row's tolerance: parameters ±1% (seed 001), ±5% (002, Sparse-MLP),
±2% (003, ViMoE), ±3% (004, Soft MoE); FLOPs ±2.5%. ✗ marks one that does not, and the row names the note that
says why. FLOPs are GMACs for seeds 001 and 003 (fvcore's convention), GFLOP = 2 × GMACs for seed 004's
Tables 1 and 8, and training exaFLOP = 3 × GMACs × 4096 × 300k for its Table 9. Seed 004's rows use its own
model (`tools/seed_specs/`: a JFT-4B head of 29k classes, no [CLS] token, global average pooling); the options
`--attention-matmuls skip` and `--dispatch-flops einsum` are the seeds' counting conventions (docs/counting.md).
The papers, in the versions of the seed texts: 001 Videau et al., "Mixture of Experts in Image Classification:
What's the Sweet Spot?"; 002 Lou, Xue, Zheng and You, "Cross-token Modeling with Conditional Computation"
(Sparse-MLP); 003 Han et al., "ViMoE" (arXiv 2410.15732); 004 Puigcerver et al., "From Sparse to Soft Mixtures
of Experts" (ICLR 2024).
"""

NOTES = """
## Notes

- **[b]** The paper disagrees with itself. Activated parameters per token are the dense ViT, plus per MoE layer
  one more expert (top-2 instead of the dense Mlp) and the router:
  ViT-S/16: 22,050,664 + 6 · (1,181,568 + 3,072) = 29,158,504 = **29.2M**, not 33.1M, with an expert of
  2·384·1536 + 1536 + 384 = 1,181,568 and a router of 384·8 = 3,072;
  ViT-B/16: 86,567,656 + 6 · (4,722,432 + 6,144) = 114,939,112 = **114.9M**, not 129.9M.
  The gaps, 3.9M and 15.0M, are about 3.3 and 3.2 experts: no count of whole experts, routers or layers gives
  them. The same ViT-S model prints 6.9G in Tables 1 and 2 and 5.3G in Table 3. MACs per image follow from the
  activated parameters: 197 tokens × 28.70M (29.16M less the position embedding, [CLS] token and head) +
  0.36G for attention's two products ≈ 6.01G, moespec's count; 33.1M activated would give about 6.8G.
- **[l]** Last 2, top-2: 22,050,664 + 2 · (1,181,568 + 3,072) = 24,419,944 = **24.4M** activated, whatever the
  number of experts; the paper prints 25.0M for 4, 8 and 16 experts, 0.6M (half an expert) more. Its total
  parameters agree (29.1M, 38.6M, 57.5M). FLOPs: one more expert on 197 tokens in 2 layers adds
  2 · 197 · 1,179,648 ≈ 0.46G to the dense 4.61G, plus routers and the combine: 5.07G. Table 1 prints 5.3G for
  this model and Table 3 prints 6.9G, Table 1's figure for "Every 2".
- **[e]** No placement and expert width gives both 54.3M and 17.0M. Every second block of each stage at
  `mlp_ratio` 2 (moespec's row, 7 layers) is 58.08M / 23.70M; counted across the stages (`{every: 2}`,
  9 layers) 73.14M / 21.20M; 9 layers at `mlp_ratio` 1, 43.48M / 17.49M. The same 54.3M is printed for two
  other models (Table 4's 4 experts and Table 6's 8 experts), which points to a copied cell.
- **[n]** Table 4's ConvNeXt rows repeat Table 3's parameter column (54.3, 47.4, 46.3 are its "every 2",
  "stage" and "last 2"). Last 2 with E experts at `mlp_ratio` 2 is 28,589,128 − 5,904,000 (the two dense Mlps,
  8d² + 5d at d = 384 and 768) + E · (2,952,576 + 1,152) (an expert, 4d² + 3d, and a router row at each):
  34.50M for 4 experts (Table 1 prints 34.5M for this model), 46.31M for 8 and 69.94M for 16.
- **[s]** One row off: "last 3" (Last 2 plus stages.2.blocks.4) is 69,926,344 + 7 · 1,181,568 + 3,072 =
  78,200,392, the 78.2M printed for "stage"; and "last 3"'s 70.0M is Last 2's 69,926,344. "Stage" (the last
  block of each stage) is 28,589,128 + Σ (7 · (8d² + 5d) + 8d) over d = 96, 192, 384, 768 = 72,519,208.
- **[x]** Tables 2, 5 and 14 print 70.0M for this model, and Table 6's own 16- and 32-expert rows follow
  28,589,128 + (E − 1) · 5,904,000 + 1,152 · E (117,167,560 and 211,649,992); for E = 8 it gives 69,926,344.
- **[i]** timm's `ConvNeXt` always builds four stages (`for i in range(4)` in `timm/models/convnext.py`), so
  no spec can ask for the isotropic model (one stage of 18 blocks after a 16 × 16 patch stem). By hand, from
  the paper's dense figures: ConvNeXt-S-8 (iso.) Last 2 adds 2 · (7 · 1,181,568 + 3,072) = 16.55M to 22.3M,
  38.85M (38.9M printed); Every 2 adds 9 layers, 74.47M: 96.77M (96.7M printed); ConvNeXt-B-8 (iso.) Last 2
  adds 2 · (7 · 4,722,432 + 6,144) = 66.13M to 82.4M, 148.5M, not 115.4M, which is 82.4M plus one such layer
  (33.06M). ConvNeXt-S (iso.) is printed with 4.3G in Table 1 and 8.7G in Table 3.
- **[t]** `moespec inspect` counts everything outside the routed experts plus the experts an image reached on a
  trained model. With the paper's 14.3 experts per image (row 146) it gives its figure: 22,013,800 (DINOv2-S/14,
  its FFN now the shared expert) + 2 routers of 384·8 = 22,019,944, plus 14.3 experts of 1,181,568: 38.92M.
- **[u]** UPerNet (the segmentation decoder of these rows) is not a timm model; moespec counts backbones.
- **[o]** A nominal size, not a count: SoViT-400m/14 is 427,680,704 parameters in timm
  (`vit_so400m_patch14_siglip_224`, MAP head, no classifier), printed as "400"; ViT-g/14 is 1.01B ("1B");
  V-MoE 15B's configuration is not in the seed.
- **[m]** The paper prints 21M (Table 1) and 22M (Table 8, row 105) for Sparse-S. By hand: Mixer-S/16's stem
  393,728 + 6 dense blocks of 2,202,564 + 2 sparse blocks of 4,392,140 + final norm 1,024 + head 513,000 =
  22,907,416. A sparse block is MoE_S 1,610,816 (4 experts of 392·512·2 + 512 + 392 = 402,312, and a router of
  392·4) + the channel MLP 2,099,712 + 2 norms 2,048 + the rescale sub-layers 679,564 (196↔392 on tokens,
  77,224 + 77,028; 512↔512 on channels, 2 · 262,656). Without the rescale sub-layers it is 21,548,288: the
  21M printed in Table 1, truncated.
- **[k]** One MoE layer (the last block), top-1 plus the shared expert, on 1,370 tokens (37 × 37 patches of the
  518 px grid the 512 px image is padded to, and [CLS]): one more FFN pass than the dense model, 1,370 ·
  1,179,648 = 1.616G, over the dense 46.8G (row 144): 48.4G. The printed 50G is what a second routed expert
  gives (+1.616G: 50.0G); the seed does not say which k its segmentation rows route with.
- **[w]** Table 14 prints 296.1M for SwinV2-S with 16 and with 32 experts. With E experts in the 9 odd blocks of
  stage 3 (d = 384: an expert of 2·384·1536 + 1536 + 384 = 1,181,568) and stage 4's last block (d = 768:
  4,722,432), SwinV2-S gains (E − 1) · (9 · 1,181,568 + 4,722,432) + E · (9 · 384 + 768) over the dense
  65.76M: 230.42M for 16 experts (296.17M, as printed) and 476.19M for 32 (541.94M); the 32-expert cell repeats
  the 16-expert one.
- **[c]** Seed 004's Table 9 tokens-choice rows, counted with `--dispatch-flops einsum`: moespec's top-k capacity
  is ceil(c·k·S / E) slots per expert in a routing group of S tokens (what `TopKRouter` runs), the implementation
  the paper measured rounds, round(c·k·S / E). Where they differ the count has E · (ceil − round) more slots per
  group, each an expert pass (2 · d · 4d MACs) for 1/g of an image and T · 2d einsum MACs per image, in each of the
  L MoE layers. S/32, 32 experts, k = 1, c = 1, S = 392 (g = 8 images of T = 49 tokens, d = 384, L = 6): 416
  slots against 384, 6 · (32 / 8 · 1,179,648 + 49 · 32 · 768) = 35.5M MACs per image more, 0.13 exaFLOP
  (× 3 × 4096 × 300k) of the row's 4.62: 4.49, within 2.5% of the printed 4.4; with 64 experts 448 slots against
  384, 0.26: 4.50. The same subtraction brings the other S/32 rows within 2.5% (k = 2, c = 1: 6.06 and 6.07 for
  6.0; 64 experts, k = 2, c = 2: 9.22 for 9.0) and B/16 64E k = 1 (75.84 − 1.26 = 74.58 for 73.2). S/32 32E
  k = 2, c = 2 (row 205) has 49 slots per expert either way: 9.33 against the printed 9.1 (+2.5%), where the
  paper prints 9.0 for the 64-expert model of the same 1,568 slots per group.
- **[g]** Seed 004's Table 9 rows routed in groups of 8 images (G = 392 tokens at /32, 1,568 at /16, 2,048 at
  H/14, 6,272 at S/8), counted with `--dispatch-flops einsum`: each image pays T · E·C · 2d MACs of dispatch
  and combine einsums per MoE layer, 8 times what a group of one image costs. The paper's figures grow less with
  the group than these einsums do. S/16, 32 experts, c = 1, L = 6, d = 384: from G = 196 (row 214: 17.5
  printed, moespec 17.52) to G = 1,568 (row 223) moespec adds 6 · 196 · (1,568 − 196) · 768 = 1.239 GMACs,
  4.57 exaFLOP (× 3 × 4096 × 300k), where the paper adds 4.0: 22.21 against the printed 21.5 (+3.3%). The
  rows with smaller groups and tokens (S/32, B/32 at G = 392) hold; the gap is in the implementation's cost of
  its einsums at large groups, which the seed does not state (moespec's default, gather dispatch, does not grow
  with the group at all).
- **[h]** The paper's own figures for ViT H/14 disagree by 10%. Table 1 prints 2060.2 training exaFLOP for the dense
  H/14 at 1M steps, which 3 × GMACs × 4096 × steps gives within 0.5% (3 × 166.765 × 4096 × 10⁶ = 2049.2), as it
  does every S, B and L row of Table 9; per step that is 2.06 · 10⁻³ exaFLOP. Table 9 prints 680.5 for the same
  model at 300k steps: 2.27 · 10⁻³ per step, 10.7% more (614.8 by the formula), and 599.2 for Soft MoE H/14
  128E (523.2 by the formula, +14.5%). Its H/14 runs are not the 300k steps of 4096 images the table states.
- **[r]** Section 3.4's "1B to 54B parameters" are the smallest and largest long-run Soft MoE: S/16 128E
  (933,478,...: 0.93B, "1B" rounded) and H/14 256E (54.18B, row 185).
"""


def write_text(path: Path, text: str) -> None:
    """`text` into `path`, atomically: a temp file beside it, then a rename."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        tmp.write(text)
    os.replace(tmp.name, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/reproduction.md differs")
    parser.add_argument("--write", action="store_true", help="write docs/reproduction.md")
    parser.add_argument("--cache", type=Path, help="a JSON file of counts to read and extend (several runs at once "
                                                   "split the work with --ids; the check does not use it)")
    parser.add_argument("--ids", help="only count these rows (FIRST-LAST), into --cache; print nothing")
    parser.add_argument("--throughput", action="store_true", help="write only the Throughput section of "
                        "docs/reproduction.md afresh (after `tools/throughput.py --measure`), the rows not recounted")
    args = parser.parse_args(argv)
    if args.throughput:
        write_text(PAGE, with_throughput(PAGE.read_text()))
        return 0
    global CACHE_FILE
    if args.cache is not None:
        CACHE_FILE = args.cache
        CACHE.update(json.loads(args.cache.read_text()) if args.cache.is_file() else {})
    if args.ids:
        first, last = map(int, args.ids.split("-"))
        for row in seed_rows():
            how = row_of(row)
            if first <= row["id"] <= last and how is not None and how.spec:
                figures(row, how)
        return 0
    text = render()
    if args.write:
        write_text(PAGE, text)
        return 0
    if not args.check:
        print(text, end="")
        return 0
    if not PAGE.is_file() or PAGE.read_text() != text:
        print("docs/reproduction.md differs from `python tools/reproduction.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

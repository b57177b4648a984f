"""After counting, before the apps: compress, a trained MoE made smaller or simpler, measured on images.

    calibration.py  route calibration images; per layer: loads, REAP scores, samples of items
    prune.py        keep the best N experts of each layer
    merge.py        merge each layer's experts into N groups (aligned, usage-weighted)
    densify.py      each MoE layer back into the dense FFN: the plain timm model
    report.py       what it cost: agreement, logit error, loads, params and GMACs before and after
    matching.py     weight matching (Hungarian) and clustering;  surgery.py: the new spec and model
"""

from .densify import densify, densify_with_report
from .merge import merge, merge_with_report
from .prune import prune, prune_with_report
from .report import CompressReport, LayerChange

__all__ = ["CompressReport", "LayerChange", "densify", "densify_with_report", "merge", "merge_with_report", "prune",
           "prune_with_report"]

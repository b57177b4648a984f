"""Stage 8, the applications built on the pipeline.

    sweep.py           stats over a grid of spec changes, with the Pareto front
    inspection.py      route labelled images, tabulate which experts each class uses
    inspect_report.py  the inspect report folder (heatmaps, load charts, index.html)
    bench.py           throughput: each MoE model and its dense backbone, timed interleaved
    evaluate.py        accuracy over an ImageFolder, as timm's validate.py measures it
    measure.py         the `bench` and `eval` commands, registered on the CLI
    plots.py           figures (matplotlib, optional)
    timm_registry.py   specs as timm models (`timm.create_model(name)`)
    timm_hook.py       moespec's architecture in timm's registry, from `import moespec` on
    hub.py             the model of a Hub folder (`timm.create_model("local-dir:..." / "hf-hub:...")`)
    timm_features.py   the feature wrapper a timm family gives its model (`features_only`), asked of the family
    hub_folder.py      moespec's writer of the Hub layout (`moespec.save_for_hf`, `--hub`), with a model card
    hub_files.py       which folder a Hub write may replace: only a Hub folder moespec wrote
"""

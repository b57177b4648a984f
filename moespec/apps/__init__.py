"""Stage 8, the applications built on the pipeline.

    sweep.py           stats over a grid of spec changes, with the Pareto front
    inspection.py      route labelled images, tabulate which experts each class uses
    inspect_report.py  the inspect report folder (heatmaps, load charts, index.html)
    plots.py           figures (matplotlib, optional)
    timm_registry.py   specs as timm models (`timm.create_model(name)`)
"""

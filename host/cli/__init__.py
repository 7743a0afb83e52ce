"""The command-line layer: `pie-run` (run.py), `pie-serve` (serve.py) and `pie-build` (build.py).

The host flags the first two share are defined once, in options.py. `python -m host.cli` is pie-run.
"""

"""The benchmarks: `npuspec bench NAME` runs npuspec/bench/NAME.py's `main` (the table in
npuspec/cli/__init__.py), and `npuspec tune` is tune.py. What several share: table.py (one table
format, medians), common.py (npuspec as a timed row, round-robin timing, acceptance metrics),
hf_runners.py (HF transformers as a row), plots.py (the optional --plot figures). The benches
sit above npuspec.serve and below npuspec.cli, which they never import (docs/design.md)."""

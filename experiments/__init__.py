"""Small CPU experiments reproducing the seed papers' headline directions (see experiments/RESULTS.md).

Each experiment is a package `experiments.<name>` run as `python -m experiments.<name>`: it trains small LoopLMs
with `titanloop.train` configs (experiments.common.train), evaluates them, and writes results.json, results.md
and a plot into runs/experiments/<name>/ (or --out). `--smoke` runs a few steps of everything (used by CI).
"""

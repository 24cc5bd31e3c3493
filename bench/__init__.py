"""Benchmarks: `make bench` (`python -m bench`) prints medians and ratios to a reference.

Each benchmark module exposes `run(ctx) -> list[Row]`; `bench/__main__.py` runs them in
one process on the same tree, prints one table and writes `bench/results/latest.md`.
Nothing here is asserted: targets are printed next to the figures.
"""

"""Benchmark and profile scripts: run each from the repository root as `python -m benchmarks.NAME`.
Results and plots go under docs/."""

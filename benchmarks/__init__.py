"""Benchmark and profile scripts by subject (harness, e2e, engine, kernels, quant, queue, reliability, ui): run
each from the repository root as `python -m benchmarks.SUBJECT.NAME`; benchmarks/README.md maps each to what
it measures and the docs/ section it rewrites."""

"""benchmarks/harness: see benchmarks/README.md."""

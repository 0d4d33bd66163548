"""benchmarks/queue: see benchmarks/README.md."""

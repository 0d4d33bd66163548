"""benchmarks/ui: see benchmarks/README.md."""

"""`tokenbus bench`: the benchmarks a user runs to size a deployment (see bench/__main__.py)."""

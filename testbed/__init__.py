"""Throwaway real parts that the tests, the benchmarks and the GPU check stand up: a redis-server on a free port
(also a Cluster and a Sentinel set), tiny random-weight checkpoints and FP8 checkpoints written from them, and
polling for a state Redis reaches by itself. It ships, so nothing shipped ever imports tests/."""

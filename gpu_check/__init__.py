"""The check of the GPU serving path on a lent GPU (`scripts/gpu_check`, docs/gpu.md): the stage runner, the
stages and what they measure with, the report, and the carry (the wheels a bare GPU image lacks) with its
rehearsal on the CPU. Nothing here may import a package the GPU image lacks at import time: the stages install
the carry first (env.ensure_engine_deps)."""

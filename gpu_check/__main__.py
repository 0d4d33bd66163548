"""`python -m gpu_check`: what `scripts/gpu_check` runs (gpu_check/runner.py)."""

import sys

from gpu_check.runner import main

sys.exit(main())

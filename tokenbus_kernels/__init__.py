"""tokenbus's kernels: the paged KV-cache write and paged attention, each beside its PyTorch reference.

    reference.py                 write_kv_ref, paged_decode_attention_ref, paged_prefill_attention_ref:
                                 the definition of "correct" (docs/kernels.md has the layout)
    kv_write.py, decode_attention.py, prefill_attention.py
                                 Triton: write_kv_triton, paged_decode_attention_triton, ... (CUDA, or CPU
                                 tensors under TRITON_INTERPRET=1); attention_tiles.py: the pieces of the K/V
                                 loop and the argument checks decode and prefill share
    cpu.py, csrc/                C++ for the CPU serving path, built once per machine: cpu.extension()

Which implementation serves a model is the engine's choice, made once (worker/engine/backends).

The package is tokenbus_kernels, not kernels: transformers 5.25 depends on Hugging Face's `kernels` package and
imports it when a model loads, and a top-level `kernels` of ours shadowed it (every model load failed, and
installing tokenbus would overwrite it in site-packages).
"""

from __future__ import annotations

import os

# Triton reads TRITON_INTERPRET once, when the @triton.jit functions are defined (first import of the kernel
# modules); the engine reads this copy to know whether CPU tensors may go to Triton
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

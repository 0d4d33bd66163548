"""What the Triton wrappers share: a planned launch (plan first, then run, so tests can compile the GPU plan
ahead of time without a GPU) and the check that a compiled kernel is not handed CPU tensors."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from triton.runtime.jit import JITFunction


class Launch(NamedTuple):
    """One planned kernel launch. The wrappers plan, then run; tests compile the GPU plan ahead of time."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    meta: dict[str, Any]  # constexpr parameters and launch options (num_warps, num_stages)

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.meta)


def attention_out(kernel: object, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """An attention wrapper's output: `out` if given, else a new tensor of q's shape and dtype; after checking
    that the kernel can run where q is (check_launchable)."""
    check_launchable(kernel, q)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out


def check_launchable(kernel: object, t: torch.Tensor) -> None:
    """A compiled (non-interpreted) kernel cannot touch CPU memory: say why instead of crashing.

    Triton reads TRITON_INTERPRET when a @triton.jit function is defined, i.e. when this module is
    first imported, so the flag must be set before anything imports tokenbus_kernels.kv_write & co.
    """
    if not t.is_cuda and isinstance(kernel, JITFunction):
        raise RuntimeError(
            "Triton kernels got CPU tensors but were compiled for the GPU: set TRITON_INTERPRET=1 in the "
            "environment before the kernels modules are first imported, or pass CUDA tensors"
        )


def head_pad(head_dim: int) -> int:
    """The power-of-two lane count a kernel's tiles use for head_dim (tl.arange needs a power of two)."""
    return 1 << (head_dim - 1).bit_length()


def check_head_dim(kernel: str, head_dim: int) -> None:
    """The attention kernels take any even head_dim from 16 to 256; non-powers of two (Phi-3's 96, 80) run
    padded to the next power of two with the extra lanes masked."""
    if head_dim % 2 or not 16 <= head_dim <= 256:
        raise ValueError(f"{kernel}: head_dim {head_dim} must be even and within 16..256")

"""An eager stand-in for CUDA graph capture, so the CPU runs StaticDecode.capture's whole loop and its replays.

install(static) replaces StaticDecode._record: a "graph" keeps the forward the capture would record (over the
static buffers, the LoRA rows and the padded cascade layout included) and its output; replay() runs that forward
again and copies the result into the same output tensor, as a replayed graph writes into its captured output.
A replayed step then reads only what StaticDecode.execute copied into the static buffers, and any host value
fixed at capture (the LoRA grid bound, the cascade prefix bound, empty host group lists) stays fixed, as in
a real graph. What it cannot show: the CUDA capture itself (gpu_check's rows do, on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class EagerGraph:
    def __init__(self, forward: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.forward = forward
        self.out = out

    def replay(self) -> None:
        self.out.copy_(self.forward())


def install(static) -> None:
    """Make `static` (a StaticDecode) capture eager stand-ins; then call static.capture()."""

    def record(forward: Callable[[], torch.Tensor], pool) -> tuple[EagerGraph, torch.Tensor, None]:
        out = forward()
        return EagerGraph(forward, out), out, None

    static._record = record

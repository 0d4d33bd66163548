"""The transformers fallback's RMSNorms on the backend's fused kernel.

transformers' RMSNorm forward is five to seven eager ops with a float32 round trip; at decode sizes on the CPU
that is a large share of a fallback step (two norms a layer, plus QK-norms in some families). Each RMSNorm
module whose output a probe shows equal to weight * x / rms(x) (the Llama form) is replaced by one call of the
backend's `rms_norm`, as the native models make. The probe runs the module itself on random rows, so variants
with other arithmetic (Gemma's (1 + w), a norm without weight, a different epsilon placement) fail it and keep
transformers' code: nothing is swapped on the strength of a class name alone.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.engine.backends import Backend


class BackendRMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps) over the last dim, through the backend's kernel (x any leading dims)."""

    def __init__(self, weight: torch.Tensor, eps: float, backend: Backend) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return self.backend.rms_norm(rows.contiguous(), self.weight, self.eps).view(x.shape)


def _epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


@torch.inference_mode()
def swap_rms_norms(model: nn.Module, backend: Backend) -> int:
    """Replace every probe-confirmed Llama-form RMSNorm in `model` with BackendRMSNorm; returns how many."""
    gen = torch.Generator().manual_seed(0)
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            weight, eps = getattr(child, "weight", None), _epsilon(child)
            if not (type(child).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor)
                    and weight.dim() == 1 and eps is not None):
                continue
            candidate = BackendRMSNorm(weight, eps, backend)
            x = (torch.randn(1, 3, weight.shape[0], generator=gen) * 3).to(weight)
            expected = child(x)
            if expected.shape == x.shape and torch.allclose(candidate(x), expected, rtol=1e-4, atol=1e-5):
                setattr(parent, name, candidate)
                swapped += 1
    return swapped

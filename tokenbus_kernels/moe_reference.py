"""Plain PyTorch mixture-of-experts: the router and the experts, the definition of "correct" for moe.py.

Layout (shared with the Triton kernel):
  x            [num_tokens, hidden]
  w13          [num_experts, 2 * inter, hidden]  each expert's gate (rows :inter) and up (rows inter:) projections,
                                                 nn.Linear layout (out, in): transformers 5's `experts.gate_up_proj`
  w2           [num_experts, hidden, inter]      each expert's down projection (`experts.down_proj`)
  topk_ids     int64 [num_tokens, top_k]         the experts each token goes to
  topk_weights [num_tokens, top_k]               their weights (float32 from the router, as transformers keeps them)
The CPU serving path runs these (no Triton on the CPU), so the experts loop over the experts that got tokens, not
over tokens, and each expert is two dense GEMMs over its tokens, as transformers' eager MoE computes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_topk_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in fp32, the top_k of it, optionally rescaled to sum to 1 (Mixtral always;
    Qwen3-MoE when its config says norm_topk_prob). Returns (weights fp32 [n, top_k], ids int64 [n, top_k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k]: [n, hidden].
    Accumulated expert by expert in expert order with index_add_, the order transformers' eager loop uses."""
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1)
    # the (token, slot) pairs sorted by expert; a stable sort keeps each expert's tokens in token order
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    top_k = topk_ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        gate_up = F.linear(x[tokens], w13[expert])
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        h = F.linear(h, w2[expert]) * topk_weights.reshape(-1)[pairs, None]
        out.index_add_(0, tokens, h.to(out.dtype))
    return out

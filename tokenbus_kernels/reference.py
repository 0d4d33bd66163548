"""Plain PyTorch versions of the kernels: the definition of "correct".

Layout shared by every kernel here and in the Triton files:
  k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]; an int8 or fp8 cache holds packed rows
                    [..., head_dim + 4] (tokenbus_kernels/kv_quant.py): written quantized, read dequantized
  block_tables      int32 [num_seqs, max_blocks_per_seq]; entries past a sequence's last block are ignored
  seq_lens          int32 [num_seqs]: tokens already in the cache for each sequence (the new ones included)
  slot_mapping      int64 [num_tokens] = block_id * block_size + offset, -1 = skip (padding)
  window            a layer's sliding window (0 = none): a query at position p sees keys at positions
                    p - window < t <= p (Hugging Face's sliding_window_overlay)
  softcap           attention-logit soft-capping (0 = none): a score s becomes softcap * tanh(s / softcap),
                    applied to the scaled score before masking (Gemma 2's attn_logit_softcapping)
  causal            prefill only: False lets every query of a sequence see all its seq_lens[i] keys (an
                    encoder's bidirectional attention; no window)
The CPU serving path runs these, so they are vectorised rather than looped per token.

The decoder layer's elementwise ops at the end of this file (RMSNorm with the residual add, rotary, SiLU*mul,
fused by norm.py, rope.py and activation.py) are Hugging Face's eager arithmetic, written out: each op runs
in the tensors' dtype (PyTorch computes an fp16/bf16 op in fp32 and rounds its result), so these equal
transformers' LlamaRMSNorm / apply_rotary_pos_emb / silu(gate) * up to the bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenbus_kernels.kv_quant import dequantize, is_quantized, quantize


def write_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter k, v [num_tokens, num_kv_heads, head_dim] into the caches at slot_mapping (in place)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    if is_quantized(k_cache):  # packed rows, copied as bytes (index_copy_ has no fp8 kernel)
        k, v = quantize(k, k_cache.dtype).view(torch.uint8), quantize(v, v_cache.dtype).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int
) -> torch.Tensor:
    """[num_seqs, num_blocks * block_size, num_kv_heads, head_dim] copy of each sequence's first blocks."""
    table = block_tables[:, :num_blocks].long().clamp(0, cache.shape[0] - 1)
    s, nb = table.shape
    _, bs, hk, d = cache.shape
    # index_select copies whole blocks as rows: several times faster here than cache[table]
    gathered = torch.index_select(cache, 0, table.reshape(-1))  # [S * nb, bs, Hk, D]
    return gathered.view(s, nb * bs, hk, d)


def _context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) [num_seqs, num_blocks * block_size, num_kv_heads, head_dim] float32: each sequence's first
    num_blocks blocks, dequantized where the cache is int8 or fp8."""
    return (dequantize(_gather_context(k_cache, block_tables, num_blocks)),
            dequantize(_gather_context(v_cache, block_tables, num_blocks)))


def _heads(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block_size, num_kv_heads, group): the cache's layout and how many q heads share each KV head."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    return block_size, num_kv_heads, q.shape[1] // num_kv_heads


def check_causal(causal: bool, window: int) -> None:
    """A sliding window is a causal notion (the keys before a query): non-causal attention takes none."""
    if not causal and window:
        raise ValueError(f"non-causal prefill attention takes no sliding window, got window {window}")


def _soft_cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(scores / softcap) * softcap if softcap else scores


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query token per sequence: q [num_seqs, num_q_heads, head_dim] -> out of the same shape.

    Sequence i attends to its first seq_lens[i] cached tokens (its own new token included), or with a
    window to the last `window` of them.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads, group = _heads(q, k_cache)
    max_len = int(seq_lens.max().item()) if num_seqs else 0
    # whole blocks are gathered (contiguous copies); each KV head then reads its strided [S, T, D] view
    keys, values = _context(k_cache, v_cache, block_tables, max(1, -(-max_len // block_size)))
    positions = torch.arange(keys.shape[1], device=q.device)
    lens = seq_lens.to(q.device).long()[:, None]
    invalid = positions[None, :] >= lens  # [S, T]
    if window:
        invalid |= positions[None, :] <= lens - 1 - window
    # slots past a sequence's end hold whatever was there (even NaN): 0 * NaN would poison the sum,
    # so they are zeroed in our own gathered copy
    values.masked_fill_(invalid[:, :, None, None], 0.0)
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    out = torch.empty(num_seqs, num_kv_heads, group, head_dim, device=q.device)
    for h in range(num_kv_heads):
        scores = _soft_cap(torch.bmm(qg[:, h], keys[:, :, h].transpose(1, 2)) * scale, softcap)  # [S, G, T]
        scores.masked_fill_(invalid[:, None, :], float("-inf"))  # also overwrites NaN from junk keys
        out[:, h] = torch.bmm(torch.softmax(scores, dim=-1), values[:, :, h])
    return out.view(num_seqs, num_q_heads, head_dim).to(q.dtype)


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    causal: bool = True,
) -> torch.Tensor:
    """Causal attention of each sequence's newest q_len tokens over all its seq_lens[i] cached tokens.

    q [num_tokens, num_q_heads, head_dim], sequences packed back to back as given by
    cu_seqlens_q int32 [num_seqs + 1]. Query j of sequence i sits at position seq_lens[i] - q_len + j and
    sees keys at positions <= its own (earlier chunks and prefix-cache hits included), and with a window
    only those > its own - window. causal False: every query sees all seq_lens[i] keys.
    """
    check_causal(causal, window)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads, group = _heads(q, k_cache)
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for i, ctx_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        keys, values = (c[0, :ctx_len] for c in _context(k_cache, v_cache, block_tables[i : i + 1],
                                                           -(-ctx_len // block_size)))
        qi = q[q_start:q_end].float().view(q_len, num_kv_heads, group, head_dim)
        scores = _soft_cap(torch.einsum("qkgd,tkd->kgqt", qi, keys) * scale, softcap)
        if causal:  # non-causal: every key is visible, nothing is masked
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            k_pos = torch.arange(ctx_len, device=q.device)
            future = k_pos[None, :] > q_pos[:, None]  # [q_len, ctx_len]
            if window:
                future |= k_pos[None, :] <= q_pos[:, None] - window  # fallen out of the window
            scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        oi = torch.einsum("kgqt,tkd->qkgd", probs, values)
        out[q_start:q_end] = oi.reshape(q_len, num_q_heads, head_dim).to(q.dtype)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden] -> weight * x / sqrt(mean(x^2) + eps): normalised in fp32, rounded to x's dtype, then
    scaled (LlamaRMSNorm); the result has x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype)).to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, x and residual [n, hidden]: residual += x, then x = rms_norm_ref(residual). Returns (x, residual)."""
    residual.copy_(residual + x)
    x.copy_(rms_norm_ref(residual, weight, eps))
    return x, residual


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # cos/sin [n, head_dim] or [n, 1, head_dim] (RotaryEmbedding.cos_sin): broadcast over the heads of x
    cos, sin = cos.view(cos.shape[0], 1, cos.shape[-1]), sin.view(sin.shape[0], 1, sin.shape[-1])
    return x * cos + _rotate_half(x) * sin


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: x = x * cos + rotate_half(x) * sin (neox / Hugging Face style) for q [n, num_heads, head_dim]
    and k [n, num_kv_heads, head_dim]; cos, sin [n, head_dim] or [n, 1, head_dim] in q's dtype. Returns (q, k)."""
    q.copy_(_rotated(q, cos, sin))
    k.copy_(_rotated(k, cos, sin))
    return q, k


def rotary_write_kv_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """q rotated in place (returned); k rotated and v written into the caches at slot_mapping (-1 = skip);
    k itself is left as it was."""
    q.copy_(_rotated(q, cos, sin))
    write_kv_ref(_rotated(k, cos, sin), v, k_cache, v_cache, slot_mapping)
    return q


def silu_and_mul_ref(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [n, 2 * inter] (gate first, then up) -> silu(gate) * up [n, inter], in `out` if given."""
    gate, up = gate_up.chunk(2, dim=-1)
    result = F.silu(gate) * up
    if out is None:
        return result
    return out.copy_(result)


def gelu_tanh_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [n, 2 * inter] -> gelu_tanh(gate) * up [n, inter]: Gemma's GeGLU, HF's gelu_pytorch_tanh."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """x [n, hidden] -> LayerNorm with weight and bias (an encoder's: BERT's nn.LayerNorm, to the bit)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def gelu_ref(x: torch.Tensor) -> torch.Tensor:
    """The exact (erf) GELU: an encoder's feed-forward activation (BERT's `gelu`)."""
    return F.gelu(x)

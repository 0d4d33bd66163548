"""The fused-MoE Triton kernel (tokenbus_kernels/moe.py) against its PyTorch reference
(tokenbus_kernels/moe_reference.py).

As tests/kernels/test_kernels_fused.py: scripts/test runs this file a second time in its TRITON_INTERPRET=1
process (INTERPRETED_SUITES), where the kernel tests run on CPU tensors; with a GPU they run on CUDA. The
plain run compiles the GPU plans for sm_90, ties the reference to transformers' own Mixtral / Qwen3-MoE
blocks, and checks the alignment's bookkeeping.

Awkward shapes on purpose: 1, 5 and 37 tokens, 3, 8 and 9 experts, top-1, top-2 and top-3, hidden and
intermediate sizes that are not powers of two, experts that get no token at all, every token on one expert,
tiles forced to 16 and 64 rows.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.support.kernel_cases import DEVICE, generator, needs_kernels, parent_only
from tests.support.sm90_compile import compile_for_sm90, stack_bytes
from tokenbus_kernels.moe_reference import fused_moe_ref, route_topk_ref

# (tokens, experts, top_k, hidden, inter, routing, tiles (block_m, block_n, block_k) or None for the defaults)
CASES = [
    (1, 8, 2, 72, 40, "random", None),
    (5, 3, 3, 64, 48, "random", (16, 32, 16)),  # top_k = experts: every expert gets every token; K loops, N tiles
    (37, 9, 2, 40, 24, "skewed", (16, 16, 16)),  # most experts empty; tails in N and K
    (37, 8, 1, 48, 80, "one", (64, None, None)),  # every token on one expert, one tile
    (20, 8, 2, 32, 16, "random", None),
]


def inputs(n, experts, top_k, hidden, inter, routing, dtype=torch.float32, device=DEVICE):
    gen = generator(n, experts, top_k, hidden, inter, routing)
    x = torch.randn(n, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    logits = torch.randn(n, experts, generator=gen)
    if routing == "skewed":  # experts 0 and 5 take everything
        logits[:, [0, 5]] += 20
    elif routing == "one":
        logits[:, 3] += 50
    weights, ids = route_topk_ref(logits, top_k, renormalize=True)
    return [t.to(device) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


@needs_kernels
@pytest.mark.parametrize("n,experts,top_k,hidden,inter,routing,tiles", CASES)
def test_fused_moe_matches_reference(n, experts, top_k, hidden, inter, routing, tiles):
    from tokenbus_kernels.moe import fused_moe_triton

    x, w13, w2, weights, ids = inputs(n, experts, top_k, hidden, inter, routing)
    block_m, block_n, block_k = tiles or (None, None, None)
    out = fused_moe_triton(x, w13, w2, weights, ids, block_m=block_m, block_n=block_n, block_k=block_k)
    ref = fused_moe_ref(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_fused_moe_strided_weights_and_no_tokens():
    """Expert weights as transposed views (any strides), and an empty batch."""
    from tokenbus_kernels.moe import fused_moe_triton

    x, w13, w2, weights, ids = inputs(6, 4, 2, 32, 24, "random")
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)
    out = fused_moe_triton(x, w13_t, w2, weights, ids)
    torch.testing.assert_close(out.cpu(), fused_moe_ref(*(t.cpu() for t in (x, w13, w2, weights, ids))),
                               rtol=1e-5, atol=1e-5)
    empty = fused_moe_triton(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 32)


@needs_kernels
def test_a_wrong_kernel_is_caught():
    """The comparison above fails for a kernel that drops the routing weights or swaps two experts."""
    x, w13, w2, weights, ids = inputs(5, 3, 2, 64, 48, "random", device="cpu")
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(fused_moe_ref(x, w13, w2, torch.ones_like(weights), ids), ref)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(fused_moe_ref(x, w13[[1, 0, 2]], w2, weights, ids), ref)


@parent_only
def test_alignment_covers_every_pair_once():
    from tokenbus_kernels.moe import moe_align

    for experts, block_m in ((9, 16), (3, 64)):
        ids = torch.tensor([[4, 1], [1, 0], [4, 1], [8, 0]]) % experts
        sorted_ids, block_experts = moe_align(ids, experts, block_m)
        pairs = sorted_ids[sorted_ids < ids.numel()]
        assert sorted(pairs.tolist()) == list(range(ids.numel()))
        tiles = sorted_ids.view(-1, block_m)
        for tile, expert in zip(tiles, block_experts.tolist(), strict=True):
            real = tile[tile < ids.numel()]
            if expert < 0:
                assert real.numel() == 0
            else:  # a tile holds one expert's pairs only, in token order
                assert (ids.reshape(-1)[real.long()] == expert).all() and real.tolist() == sorted(real.tolist())


@parent_only
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_reference_equals_transformers_moe_block(model_type):
    """The router and experts reference reproduce transformers' own sparse MoE block (both renormalisations)."""
    from transformers import AutoConfig

    if model_type == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        fields = dict(num_local_experts=5, num_experts_per_tok=2)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        fields = dict(num_experts=5, num_experts_per_tok=3, norm_topk_prob=False, moe_intermediate_size=24)
    config = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=24, **fields)
    torch.manual_seed(0)
    block = Block(config).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(1, 7, 32)
    with torch.no_grad():
        expected = block(x)[0] if isinstance(block(x), tuple) else block(x)
        weights, ids = route_topk_ref(x[0] @ block.gate.weight.T, config.num_experts_per_tok,
                                      renormalize=getattr(config, "norm_topk_prob", True))
        out = fused_moe_ref(x[0], block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
    torch.testing.assert_close(out, expected.reshape(7, 32), rtol=0, atol=1e-6)


@parent_only
def test_gpu_plans_compile_for_sm90(tmp_path):
    """The two grouped GEMMs compile for sm_90 in bf16 (Mixtral-8x7B and Qwen3-30B-A3B shapes) and fp32,
    without register spills."""
    from tokenbus_kernels.moe import moe_align, plan_moe_gemm

    launches = []
    for dtype, experts, top_k, hidden, inter, block_m in (
        (torch.bfloat16, 8, 2, 4096, 14336, 64), (torch.bfloat16, 128, 8, 2048, 768, 16),
        (torch.float32, 8, 2, 64, 48, 16),
    ):
        ids = torch.randint(0, experts, (4, top_k))
        sorted_ids, block_experts = moe_align(ids, experts, block_m)
        x = torch.empty(4, hidden, dtype=dtype)
        w13 = torch.empty(experts, 2 * inter, hidden, dtype=dtype)
        w2 = torch.empty(experts, hidden, inter, dtype=dtype)
        gate_up = torch.empty(4 * top_k, 2 * inter, dtype=dtype)
        weights = torch.empty(4 * top_k)
        launches += plan_moe_gemm(x, w13, gate_up, weights, sorted_ids, block_experts, 4 * top_k, top_k, False,
                                  block_m, on_gpu=True)
        h = torch.empty(4 * top_k, inter, dtype=dtype)
        down = torch.empty(4 * top_k, hidden, dtype=dtype)
        launches += plan_moe_gemm(h, w2, down, weights, sorted_ids, block_experts, 4 * top_k, 1, True, block_m,
                                  on_gpu=True)
    for launch in launches:
        compiled = compile_for_sm90(launch)
        assert stack_bytes(compiled.asm["cubin"], tmp_path) == 0, "the MoE GEMM spills registers"
        if launch.args[0].dtype == torch.bfloat16:  # fp32 stays IEEE (no TF32), so no tensor cores there
            assert re.search(r"\b(w?gmma|mma)\.", compiled.asm["ptx"]), "bf16 grouped GEMM without tensor cores"

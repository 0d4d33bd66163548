"""Cascade decode attention's test cases (tokenbus_kernels/cascade.py), shared by the reference, C++ and Triton suites:
paged caches whose groups of rows hold the same first tokens, junk in every slot no row may read, rows of a
group scattered over the batch, and the CascadeLayout that says so.

A case is (groups, alone): groups [(prefix tokens, [each member's own tokens after it])], alone [each other
row's tokens]. A prefix that ends mid-block shares its whole blocks physically and copies the partial
block's first rows into every member's own block (the contract: the same K/V for the first prefix tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.support.kernel_cases import UNUSED_BLOCK, cdiv, generator
from tokenbus_kernels.cascade import CascadeLayout
from tokenbus_kernels.kv_quant import QUANTIZED, quantize

# (name, groups, alone): the awkward shapes, at block size 16
SHAPES = [
    ("group_of_1", [(32, [5])], [9, 40]),
    ("all_in_one_group", [(48, [1, 7, 16, 30, 2])], []),
    ("several_groups", [(32, [3, 9]), (80, [1, 20, 4]), (16, [16])], [1, 17]),
    ("prefix_mid_block", [(37, [2, 11, 29])], [5]),
    ("prefix_at_block_edge", [(64, [1, 15, 16, 17])], []),
    ("zero_suffix", [(48, [0, 0, 5]), (21, [0, 3])], [7]),
]


@dataclass
class CascadeCase:
    q: torch.Tensor  # [num_seqs, hq, head_dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    layout: CascadeLayout
    scale: float


def cascade_case(groups: list[tuple[int, list[int]]], alone: list[int], block_size: int, num_kv_heads: int,
                 gqa: int, head_dim: int, dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None,
                 device: str = "cpu", seed: object = 0) -> CascadeCase:
    kv_dtype = kv_dtype or dtype
    gen = generator(groups, alone, block_size, num_kv_heads, gqa, head_dim, str(dtype), str(kv_dtype), seed)
    lens = [p + own for p, owns in groups for own in owns] + alone
    num_seqs = len(lens)
    rows = torch.randperm(num_seqs, generator=gen).tolist()  # a group's members scattered over the batch
    num_blocks = sum(cdiv(n, block_size) for n in lens) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen) * 2
    v = torch.randn(shape, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(cdiv(n, block_size) for n in lens) + 1
    table = torch.full((num_seqs, width), UNUSED_BLOCK, dtype=torch.int32)
    seq_lens = [0] * num_seqs
    layout_groups, at = [], 0
    for prefix_len, owns in groups:
        members = rows[at : at + len(owns)]
        at += len(owns)
        shared = [free.pop() for _ in range(prefix_len // block_size)]  # whole blocks: one physical copy
        first_own_block = None
        for row, own in zip(members, owns, strict=True):
            n = prefix_len + own
            blocks = shared + [free.pop() for _ in range(cdiv(n, block_size) - len(shared))]
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            seq_lens[row] = n
            tail = prefix_len % block_size
            if tail:  # the prefix's partial block: the first member's rows, copied into each member's block
                if first_own_block is None:
                    first_own_block = blocks[len(shared)]
                else:
                    k[blocks[len(shared)], :tail] = k[first_own_block, :tail]
                    v[blocks[len(shared)], :tail] = v[first_own_block, :tail]
        layout_groups.append((members, prefix_len))
    for row, n in zip(rows[at:], alone, strict=True):
        blocks = [free.pop() for _ in range(cdiv(n, block_size))]
        table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        seq_lens[row] = n
    if kv_dtype in QUANTIZED:
        k_cache, v_cache = quantize(k, kv_dtype), quantize(v, kv_dtype)
    else:
        k_cache, v_cache = k.to(kv_dtype), v.to(kv_dtype)
    junk = torch.ones(num_blocks, block_size, dtype=torch.bool)  # every slot no row reads: NaN (or 0x7f)
    for row, n in enumerate(seq_lens):
        t = torch.arange(n)
        junk[table[row, t // block_size].long(), t % block_size] = False
    for cache in (k_cache, v_cache):
        if kv_dtype in QUANTIZED:  # as bytes (masked_fill has no fp8 kernel): 0x7f is fp8's NaN, a huge scale
            cache.view(torch.uint8)[junk] = 0x7F
        else:
            cache[junk] = float("nan")
    q = torch.randn(num_seqs, num_kv_heads * gqa, head_dim, generator=gen).to(dtype)
    return CascadeCase(q.to(device), k_cache.to(device), v_cache.to(device), table.to(device),
                       torch.tensor(seq_lens, dtype=torch.int32, device=device),
                       CascadeLayout.build(layout_groups, num_seqs, device), head_dim**-0.5)

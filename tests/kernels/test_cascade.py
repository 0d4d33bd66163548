"""Cascade decode attention (tokenbus_kernels/cascade.py): the PyTorch reference equals plain paged decode attention
(tokenbus_kernels/reference.py), and the C++ kernel (csrc/cpu_cascade_attention.cpp) equals the reference, on the
awkward shapes of tests/support/cascade_cases.py: a group of 1, every row in one group, several groups,
prefixes ending mid-block and at a block edge, suffixes of zero tokens, GQA 1/3/8, int8 / bf16 / fp8 KV,
sliding windows that start inside the prefix (and past it), soft-capping."""

from __future__ import annotations

import pytest
import torch

from tests.support.cascade_cases import SHAPES, cascade_case
from tests.support.kernel_cases import UNUSED_BLOCK, case_id
from tokenbus_kernels.cascade import CascadeLayout, cascade_decode_attention_ref
from tokenbus_kernels.reference import paged_decode_attention_ref

GQA = [1, 3, 8]
# (window, softcap): none; a window of 5 (inside the prefix for short suffixes, past it for long ones); 40
# (inside the longer prefixes); soft-capping alone and with a window
MASKS = [(0, 0.0), (5, 0.0), (40, 0.0), (0, 30.0), (19, 20.0)]
SHAPE_IDS = [name for name, _, _ in SHAPES]


def plain(case, window=0, softcap=0.0):
    return paged_decode_attention_ref(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                      case.scale, window, softcap)


def cascade_ref(case, window=0, softcap=0.0):
    return cascade_decode_attention_ref(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                        case.layout, case.scale, window, softcap)


def others_lose_the_prefix(case) -> None:
    """Every member but a group's first forgets its shared whole blocks (table entries that would fault): a
    cascade reads them through the first member only."""
    block_size = case.k_cache.shape[1]
    bounds = case.layout.group_starts.tolist()
    for g, prefix_len in enumerate(case.layout.prefix_lens.tolist()):
        for row in case.layout.group_rows[bounds[g] + 1 : bounds[g + 1]].tolist():
            case.block_tables[row, : prefix_len // block_size] = UNUSED_BLOCK


@pytest.mark.parametrize("window,softcap", MASKS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8, torch.float8_e4m3fn], ids=case_id)
@pytest.mark.parametrize("gqa", GQA)
@pytest.mark.parametrize("groups,alone", [s[1:] for s in SHAPES], ids=SHAPE_IDS)
def test_reference_equals_plain_decode(groups, alone, gqa, kv_dtype, window, softcap):
    case = cascade_case(groups, alone, 16, 2, gqa, 64, kv_dtype=kv_dtype)
    want = plain(case, window, softcap)
    others_lose_the_prefix(case)
    got = cascade_ref(case, window, softcap)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reference_sees_a_wrong_layout():
    """The comparison can fail: a layout claiming a longer shared prefix than the rows share is caught."""
    case = cascade_case([(32, [5, 9])], [], 16, 2, 3, 64)
    rows = case.layout.group_rows.tolist()
    case.layout = CascadeLayout.build([(rows, 48)], 2)  # the members' third blocks differ
    assert not torch.allclose(cascade_ref(case), plain(case), rtol=1e-5, atol=1e-5)


def test_layout_refuses_a_row_twice():
    with pytest.raises(ValueError, match="distinct rows"):
        CascadeLayout.build([([0, 1], 16), ([1], 16)], 3)
    with pytest.raises(ValueError, match="below 2"):
        CascadeLayout.build([([0, 2], 16)], 2)


def run_cpu(ext, case, window=0, softcap=0.0):
    lay = case.layout
    return ext.cascade_decode_attention_cpu(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                            lay.group_rows, lay.group_starts, lay.prefix_lens, lay.suffix_starts,
                                            case.scale, window, softcap)


@pytest.mark.parametrize("window,softcap", MASKS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=case_id)
@pytest.mark.parametrize("gqa", GQA)
@pytest.mark.parametrize("groups,alone", [s[1:] for s in SHAPES], ids=SHAPE_IDS)
def test_cpu_equals_reference(ext, groups, alone, gqa, kv_dtype, window, softcap):
    case = cascade_case(groups, alone, 16, 2, gqa, 64, kv_dtype=kv_dtype)
    want = plain(case, window, softcap)
    others_lose_the_prefix(case)
    got = run_cpu(ext, case, window, softcap)
    torch.testing.assert_close(got, cascade_ref(case, window, softcap), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim,block_size", [(32, 16), (128, 16), (80, 8), (64, 32)])
def test_cpu_other_head_dims_and_blocks(ext, head_dim, block_size):
    """head_dim 64 and 128 are compiled constants, others a run-time loop; a long prefix splits into chunks."""
    groups = [(10 * block_size, [1, 3, 2 * block_size + 1]), (2 * block_size + 5, [block_size, 0])]
    case = cascade_case(groups, [block_size + 3], block_size, 3, 3, head_dim, kv_dtype=torch.float32)
    want = plain(case, 7, 0.0)
    others_lose_the_prefix(case)
    torch.testing.assert_close(run_cpu(ext, case, 7, 0.0), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run_cpu(ext, case), cascade_ref(case), rtol=1e-5, atol=1e-5)


def test_cpu_many_rows_in_one_group(ext):
    """64 members x GQA 3 (SmolLM2's step behind one system prompt): 192 query rows per KV head in one item."""
    case = cascade_case([(512, [1 + i % 40 for i in range(64)])], [], 16, 3, 3, 64)
    want = plain(case)
    others_lose_the_prefix(case)
    torch.testing.assert_close(run_cpu(ext, case), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=case_id)
@pytest.mark.parametrize("window", [0, 40, 700])
def test_cpu_long_prefix_in_chunks(ext, kv_dtype, window):
    """A prefix past the C++ phase 1's chunk (1024 tokens) splits into matrix products merged by log-sum-exp,
    one ending mid-block; a window of 40 starts past the whole first chunk for every row (skipped), 700 inside
    it; a second, shorter group leaves its second chunk's partials empty."""
    case = cascade_case([(1024 + 48 + 5, [1, 9, 30]), (300, [2, 17])], [3], 16, 2, 3, 64, kv_dtype=kv_dtype)
    want = plain(case, window)
    others_lose_the_prefix(case)
    torch.testing.assert_close(run_cpu(ext, case, window), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # a second build of the extension (~32 s) the first time on a machine, cached afterwards
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=case_id)
def test_cpu_avx2_build(kv_dtype):
    """The AVX2 build's vectors (8 lanes) in the softmax rows of phase 1: a mid-block prefix, a window, a
    soft-cap, several groups."""
    from tokenbus_kernels import cpu

    module = cpu.extension(avx2_only=True)
    assert module is not None
    for window, softcap in [(0, 0.0), (19, 20.0)]:
        case = cascade_case([(37, [2, 11, 29]), (80, [1, 20])], [5], 16, 2, 3, 64, kv_dtype=kv_dtype)
        want = plain(case, window, softcap)
        others_lose_the_prefix(case)
        torch.testing.assert_close(run_cpu(module, case, window, softcap), want, rtol=1e-5, atol=1e-5)


def test_cpu_refuses_a_bad_layout(ext):
    case = cascade_case([(32, [5, 9])], [3], 16, 2, 3, 64)
    lay = case.layout
    with pytest.raises(RuntimeError, match="one suffix_start per row"):
        ext.cascade_decode_attention_cpu(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                         lay.group_rows, lay.group_starts, lay.prefix_lens, lay.suffix_starts[:2],
                                         case.scale, 0, 0.0)
    with pytest.raises(RuntimeError, match="int32"):
        ext.cascade_decode_attention_cpu(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                         lay.group_rows.long(), lay.group_starts, lay.prefix_lens, lay.suffix_starts,
                                         case.scale, 0, 0.0)

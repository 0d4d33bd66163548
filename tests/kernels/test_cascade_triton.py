"""The Triton cascade decode attention (tokenbus_kernels/cascade_attention.py) against the PyTorch reference
(tokenbus_kernels/cascade.py) and plain paged decode, on tests/support/cascade_cases.py's awkward shapes. Runs in
scripts/test's TRITON_INTERPRET=1 process (CPU tensors), and on CUDA in the parent where there is a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_cascade import GQA, SHAPE_IDS, SHAPES, cascade_ref, others_lose_the_prefix
from tests.support.cascade_cases import cascade_case
from tests.support.kernel_cases import DEVICE, case_id, needs_kernels, parent_only
from tests.support.sm90_compile import check_attention_compiles, compile_for_sm90
from tokenbus_kernels.reference import paged_decode_attention_ref

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1e-2)}


def run(case, window=0, softcap=0.0, partition_size=None):
    from tokenbus_kernels.cascade_attention import cascade_decode_attention_triton

    out = torch.full_like(case.q, float("nan"))  # every row must be written
    return cascade_decode_attention_triton(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                           case.layout, case.scale, out=out, window=window, softcap=softcap,
                                           partition_size=partition_size)


def check(case, window=0, softcap=0.0, partition_size=None):
    want = paged_decode_attention_ref(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                      case.scale, window, softcap)
    others_lose_the_prefix(case)
    got = run(case, window, softcap, partition_size)
    rtol, atol = TOLERANCE[case.q.dtype]
    torch.testing.assert_close(got, cascade_ref(case, window, softcap), rtol=rtol, atol=atol)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@needs_kernels
@pytest.mark.parametrize("gqa", GQA)
@pytest.mark.parametrize("groups,alone", [s[1:] for s in SHAPES], ids=SHAPE_IDS)
def test_shapes(groups, alone, gqa):
    check(cascade_case(groups, alone, 16, 2, gqa, 64, device=DEVICE))


@needs_kernels
@pytest.mark.parametrize("window,softcap", [(5, 0.0), (40, 0.0), (0, 30.0), (19, 20.0)])
@pytest.mark.parametrize("groups,alone", [s[1:] for s in SHAPES if s[0] in ("several_groups", "zero_suffix")],
                         ids=["several_groups", "zero_suffix"])
def test_windows_and_softcap(groups, alone, window, softcap):
    check(cascade_case(groups, alone, 16, 2, 3, 64, device=DEVICE), window, softcap)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float16], ids=case_id)
@pytest.mark.parametrize("window", [0, 40])
def test_kv_dtypes(kv_dtype, window):
    dtype = torch.float16 if kv_dtype == torch.float16 else torch.float32
    groups, alone = SHAPES[2][1:]
    check(cascade_case(groups, alone, 16, 2, 8, 64, dtype=dtype, kv_dtype=kv_dtype, device=DEVICE), window)


@needs_kernels
@pytest.mark.parametrize("partition_size", [16, 32])
def test_many_partitions(partition_size):
    """Both parts split into several partitions (shared and own), merged by stage 2; head_dim 80 runs padded."""
    groups = [(96, [1, 40, 17]), (37, [33, 0])]
    check(cascade_case(groups, [70], 16, 2, 3, 80, device=DEVICE), 19, 0.0, partition_size)
    check(cascade_case(groups, [70], 16, 2, 3, 80, device=DEVICE), 0, 0.0, partition_size)


@parent_only
@pytest.mark.parametrize("dtype,hq,hk,head_dim", [(torch.bfloat16, 9, 3, 64), (torch.bfloat16, 32, 8, 128),
                                                  (torch.float32, 12, 4, 32)])
def test_gpu_plans_compile_for_sm90(dtype, hq, hk, head_dim, tmp_path):
    """The shared part's kernel and the own part's CASCADE variants compile for sm_90 without spills; the
    shared part's K/V loop is software-pipelined like plain decode's."""
    from tokenbus_kernels.cascade_attention import plan_cascade

    case = cascade_case([(64, [1, 3, 5, 2, 9]), (32, [4])], [7], 16, hk, hq // hk, head_dim, dtype=dtype)
    launches = plan_cascade(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.layout,
                            0.1, torch.empty_like(case.q), on_gpu=True)
    assert [launch.kernel.__name__ for launch in launches] == [
        "_cascade_prefix_kernel", "_decode_partition_kernel", "_decode_reduce_kernel"]
    check_attention_compiles(launches, tmp_path)
    assert "async_copy_global_to_local" in compile_for_sm90(launches[0]).asm["ttgir"], "shared K/V loop not pipelined"

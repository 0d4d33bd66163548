"""The LoRA SGMV kernels (tokenbus_kernels/lora.py) against their PyTorch reference (lora_reference.py beside it), and
the reference against PEFT's own arithmetic (a per-row loop of `lora_B(lora_A(x)) * scaling`).

scripts/test runs this file a second time in its TRITON_INTERPRET=1 process (INTERPRETED_SUITES), where the
kernel tests run on CPU tensors; with a GPU they run on CUDA. Awkward shapes on purpose: rows of one adapter
only, every row a different adapter, rank 1, empty groups (slots no row uses), base rows in between, fused
slices (q, k, v) whose widths are not tile multiples.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.support.kernel_cases import DEVICE, generator, needs_kernels, parent_only
from tests.support.sm90_compile import compile_for_sm90, stack_bytes
from tokenbus_kernels.lora_reference import groups_of, lora_apply_ref, lora_ref, sort_rows_by_slot

# (rows, in, slices' widths, slots, max rank, ranks per slot, slot of each row: a rule)
CASES = [
    (9, 40, (24,), 3, 8, (8, 8, 8), "one"),  # every row on slot 1; slots 0 and 2 empty
    (7, 64, (32, 16, 16), 8, 16, (16, 1, 16, 8, 16, 4, 16, 2), "distinct"),  # every row its own slot
    (5, 48, (40,), 2, 1, (1, 1), "mixed"),  # rank 1
    (37, 72, (48, 24), 4, 64, (64, 8, 0, 16), "mixed"),  # base rows, an empty slot, rank 64 (two K steps)
    (1, 32, (32,), 4, 8, (8, 8, 8, 8), "base"),  # no adapter row at all
    # the CPU kernel's blocks of 6 rows (a group of 23 on slot 1: 6 + 6 + 6 + 5) and its 64-column tiles with a tail
    (23, 96, (128, 64, 70), 3, 16, (16, 16, 5), "one"),
]


def slot_rule(n: int, num_slots: int, rule: str, gen: torch.Generator) -> torch.Tensor:
    if rule == "one":
        return torch.full((n,), 1, dtype=torch.int64)
    if rule == "distinct":
        return torch.arange(n, dtype=torch.int64) % num_slots
    if rule == "base":
        return torch.full((n,), -1, dtype=torch.int64)
    slots = torch.randint(-1, num_slots, (n,), generator=gen)
    slots[slots == 2] = -1  # slot 2 stays empty
    return slots


def inputs(n, in_features, widths, num_slots, max_rank, ranks, rule, dtype=torch.float32):
    gen = generator(n, in_features, widths, num_slots, max_rank, ranks, rule)
    out_features = sum(widths)
    slices = tuple((sum(widths[:j]), w) for j, w in enumerate(widths))
    x = torch.randn(n, in_features, generator=gen)
    a = torch.zeros(num_slots, len(widths) * max_rank, in_features)
    b = torch.zeros(num_slots, out_features, max_rank)
    for s, r in enumerate(ranks):  # zero past each slot's rank, as the slots hold them
        for j in range(len(widths)):
            a[s, j * max_rank : j * max_rank + r] = torch.randn(r, in_features, generator=gen) * 0.2
        b[s, :, :r] = torch.randn(out_features, r, generator=gen) * 0.2
    y = torch.randn(n, out_features, generator=gen)
    slots = slot_rule(n, num_slots, rule, gen)
    return x.to(dtype), a.to(dtype), b.to(dtype), y.to(dtype), slices, slots


def peft_rowwise(x, a, b, y, slices, slots):
    """What PEFT computes for each row on its own: y + lora_B(lora_A(x)), slice by slice."""
    out = y.clone()
    rank = b.shape[2]
    for r, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for j, (off, w) in enumerate(slices):
            t = x[r] @ a[s, j * rank : (j + 1) * rank].T
            out[r, off : off + w] += t @ b[s, off : off + w].T
    return out


@parent_only
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[-1] + f"-{c[0]}")
def test_reference_equals_rowwise_peft(case):
    x, a, b, y, slices, slots = inputs(*case)
    rows, starts, counts = sort_rows_by_slot(slots, a.shape[0])
    want = peft_rowwise(x, a, b, y, slices, slots)
    torch.testing.assert_close(lora_ref(y.clone(), x, a, b, slices, rows, starts, counts), want, rtol=1e-5, atol=1e-5)
    grouped = lora_apply_ref(y.clone(), x, a, b, slices, rows, groups_of(starts, counts))  # the CPU path
    torch.testing.assert_close(grouped, want, rtol=1e-5, atol=1e-5)
    assert sorted(rows.tolist()) == [r for r, s in enumerate(slots.tolist()) if s >= 0]


@parent_only
def test_a_wrong_grouping_is_caught():
    """The comparison fails for rows given another slot's weights, or one slice's rank block swapped."""
    x, a, b, y, slices, slots = inputs(*CASES[1])
    want = peft_rowwise(x, a, b, y, slices, slots)
    rows, starts, counts = sort_rows_by_slot((slots + 1) % a.shape[0], a.shape[0])
    with pytest.raises(AssertionError):
        torch.testing.assert_close(lora_ref(y.clone(), x, a, b, slices, rows, starts, counts), want)
    rows, starts, counts = sort_rows_by_slot(slots, a.shape[0])
    swapped = a.clone()
    swapped[:, :16], swapped[:, 16:32] = a[:, 16:32], a[:, :16]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(lora_ref(y.clone(), x, swapped, b, slices, rows, starts, counts), want)


def check_cpu_kernel(ext, case) -> None:
    x, a, b, y, slices, slots = inputs(*case)
    rows, starts, counts = sort_rows_by_slot(slots, a.shape[0])
    ranks = torch.tensor(case[5], dtype=torch.int32)
    bt = b.transpose(1, 2).contiguous()  # the kernel's layout: [slots, rank, out]
    want = peft_rowwise(x, a, b, y, slices, slots)
    got = y.clone()
    ext.lora_cpu(got, x, a, bt, [o for o, _ in slices], [w for _, w in slices], rows, starts, counts, ranks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if case[-1] != "base" and max(case[5]) > 1:
        short = y.clone()
        ext.lora_cpu(short, x, a, bt, [o for o, _ in slices], [w for _, w in slices], rows, starts, counts,
                     (ranks // 2).to(torch.int32))
        with pytest.raises(AssertionError):
            torch.testing.assert_close(short, want, rtol=1e-5, atol=1e-5)


@parent_only
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[-1] + f"-{c[0]}")
def test_cpu_kernel_matches_reference(ext, case):
    """The C++ kernel (csrc/cpu_lora.cpp) computes each slot at its own rank: a rank given too low must fail."""
    check_cpu_kernel(ext, case)


@parent_only
@pytest.mark.slow  # builds a second copy of the extension (~32 s) the first time on a machine, cached afterwards
def test_cpu_kernel_avx2_path_matches_reference():
    """The AVX2 build (ymm vectors: 16-column expand tiles) compiled with -mno-avx512f where the machine has
    AVX-512; on an AVX2-only machine this is the ordinary build."""
    from tokenbus_kernels import cpu

    module = cpu.extension(avx2_only=True)
    assert module is not None
    for case in CASES:
        check_cpu_kernel(module, case)


@parent_only
def test_cpu_kernel_refuses_a_bad_layout(ext):
    """b in its [slots, out, rank] layout (not the transposed storage) or groups that miss a row: refused."""
    x, a, b, y, slices, slots = inputs(*CASES[1])
    rows, starts, counts = sort_rows_by_slot(slots, a.shape[0])
    ranks = torch.tensor(CASES[1][5], dtype=torch.int32)
    offsets, widths = [o for o, _ in slices], [w for _, w in slices]
    with pytest.raises(RuntimeError, match="disagree"):
        ext.lora_cpu(y.clone(), x, a, b.contiguous(), offsets, widths, rows, starts, counts, ranks)
    short = counts.clone()
    short[int(torch.nonzero(counts)[0])] -= 1
    with pytest.raises(RuntimeError, match="groups cover"):
        ext.lora_cpu(y.clone(), x, a, b.transpose(1, 2).contiguous(), offsets, widths, rows, starts, short, ranks)


@needs_kernels
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[-1] + f"-{c[0]}")
def test_kernels_match_reference(case):
    from tokenbus_kernels.lora import lora_expand_triton, lora_shrink_triton

    x, a, b, y, slices, slots = (t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in inputs(*case))
    rows, starts, counts = sort_rows_by_slot(slots, a.shape[0])
    max_count = int(counts.max())
    t = lora_shrink_triton(x, a, rows, starts, counts, max_count)
    got = lora_expand_triton(y.clone(), t, b, slices, rows, starts, counts, max_count)
    want = lora_ref(y.cpu().clone(), x.cpu(), a.cpu(), b.cpu(), slices, rows.cpu(), starts.cpu(), counts.cpu())
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    for s, start, count in groups_of(starts.cpu(), counts.cpu()):  # the shrink itself, row by row
        idx = rows[start : start + count]
        torch.testing.assert_close(t[idx].cpu(), (x[idx] @ a[s].T).cpu(), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_a_padded_grid_and_strided_output():
    """A grid sized for more rows than any group has (a CUDA graph's fixed grid), base rows left bit-equal,
    and y a column view of a wider tensor (a fused output's slice)."""
    from tokenbus_kernels.lora import lora_expand_triton, lora_shrink_triton

    x, a, b, y, slices, slots = (t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in inputs(*CASES[3]))
    rows, starts, counts = sort_rows_by_slot(slots, a.shape[0])
    wide = torch.randn(y.shape[0], y.shape[1] + 8, device=DEVICE)
    wide[:, 4 : 4 + y.shape[1]] = y
    view = wide[:, 4 : 4 + y.shape[1]]
    t = lora_shrink_triton(x, a, rows, starts, counts, max_count=64)
    lora_expand_triton(view, t, b, slices, rows, starts, counts, max_count=64)
    want = lora_ref(y.cpu().clone(), x.cpu(), a.cpu(), b.cpu(), slices, rows.cpu(), starts.cpu(), counts.cpu())
    torch.testing.assert_close(view.cpu(), want, rtol=1e-5, atol=1e-5)
    base = (slots < 0).cpu()
    assert torch.equal(view.cpu()[base], y.cpu()[base])


@parent_only
def test_gpu_plans_compile_for_sm90(tmp_path):
    """Shrink and expand compile for sm_90 without spills: bf16 on tensor cores (Llama-3.1-8B's qkv_proj and
    down_proj at rank 16, 8 slots), fp32 in IEEE fp32."""
    from tokenbus_kernels.lora import plan_expand, plan_shrink

    launches = []
    for dtype, in_features, widths, rank in ((torch.bfloat16, 4096, (4096, 1024, 1024), 16),
                                             (torch.bfloat16, 14336, (4096,), 16), (torch.float32, 64, (32,), 8)):
        rows, starts, counts = sort_rows_by_slot(torch.arange(32) % 8, 8)
        x = torch.empty(32, in_features, dtype=dtype)
        a = torch.empty(8, len(widths) * rank, in_features, dtype=dtype)
        t = torch.empty(32, len(widths) * rank, dtype=dtype)
        b = torch.empty(8, sum(widths), rank, dtype=dtype)
        y = torch.empty(32, sum(widths), dtype=dtype)
        slices = tuple((sum(widths[:j]), w) for j, w in enumerate(widths))
        launches += plan_shrink(x, a, rows, starts, counts, 4, t, on_gpu=True)
        launches += plan_expand(y, t, b, slices, rows, starts, counts, 4, on_gpu=True)[:1]
    for launch in launches:
        compiled = compile_for_sm90(launch)
        assert stack_bytes(compiled.asm["cubin"], tmp_path) == 0, "a LoRA kernel spills registers"
        if launch.args[0].dtype == torch.bfloat16:
            assert re.search(r"\b(w?gmma|mma)\.", compiled.asm["ptx"]), "bf16 LoRA GEMM without tensor cores"


@needs_kernels
def test_bf16_within_rounding():
    from tokenbus_kernels.lora import lora_expand_triton, lora_shrink_triton

    x, a, b, y, slices, slots = (t.to(DEVICE) if isinstance(t, torch.Tensor) else t
                                 for t in inputs(*CASES[1], dtype=torch.bfloat16))
    rows, starts, counts = sort_rows_by_slot(slots, a.shape[0])
    t = lora_shrink_triton(x, a, rows, starts, counts, int(counts.max()))
    got = lora_expand_triton(y.clone(), t, b, slices, rows, starts, counts, int(counts.max()))
    want = peft_rowwise(*(v.float().cpu() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                          for v in (x, a, b, y)), slices, slots.cpu())
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2)

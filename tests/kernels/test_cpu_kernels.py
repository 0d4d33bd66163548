"""The C++ CPU kernels (tokenbus_kernels/cpu.py, tokenbus_kernels/csrc/cpu_kernels.cpp and the cpu_*attention*.cpp
files) against the PyTorch references, on fresh random inputs of awkward shapes, and the CPU dispatch
that picks them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.kernel_cases import LENGTH_CASES, count_calls, paged_cache, prefill_inputs, strided
from tokenbus_kernels import cpu
from tokenbus_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, write_kv_ref
from worker.engine.backends import CpuBackend, select_backend

# (block_size, num_q_heads, num_kv_heads, head_dim): SmolLM2's shape, MHA, GQA 3 and 8, MQA, odd head_dim
DECODE_CASES = [(16, 9, 3, 64), (16, 4, 4, 32), (32, 16, 2, 128), (8, 7, 1, 48), (64, 6, 2, 80), (16, 24, 8, 64)]


@pytest.mark.parametrize("block_size,hq,hk,head_dim", DECODE_CASES)
def test_decode_matches_reference(ext, block_size, hq, hk, head_dim):
    gen = torch.Generator().manual_seed(block_size * 1000 + hq * 10 + head_dim)
    lens = LENGTH_CASES(block_size) + [int(n) for n in torch.randint(1, 9 * block_size, (5,), generator=gen)]
    # table entries past each sequence's blocks are 2**30: reading one would fault
    k_cache, v_cache, table = paged_cache(lens, block_size, hk, head_dim, torch.float32, gen, device="cpu")
    q = strided(torch.randn(len(lens), hq, head_dim, generator=gen), gen)  # a qkv-split-like view
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    out = ext.paged_decode_attention_cpu(q, k_cache, v_cache, table, seq_lens, scale, 0, 0.0)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, table, seq_lens, scale)
    assert out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_ignores_junk_past_each_sequence(ext):
    """Slots after a sequence's last token may hold anything, NaN included: they must not reach the output."""
    gen = torch.Generator().manual_seed(3)
    lens = [5, 16, 17]
    k_cache, v_cache, table = paged_cache(lens, 16, 2, 32, torch.float32, gen, device="cpu")
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    for i, n in enumerate(lens):
        last = int(table[i, (n - 1) // 16])
        k_cache[last, (n - 1) % 16 + 1 :] = float("nan")
        v_cache[last, (n - 1) % 16 + 1 :] = float("inf")
    q = torch.randn(3, 6, 32, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = ext.paged_decode_attention_cpu(q, k_cache, v_cache, table, seq_lens, 0.17, 0, 0.0)
    torch.testing.assert_close(out, paged_decode_attention_ref(q, ref_k, ref_v, table, seq_lens, 0.17),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size,hk,head_dim", [(16, 3, 64), (32, 1, 128), (8, 4, 48)])
def test_write_kv_is_bit_exact(ext, block_size, hk, head_dim):
    gen = torch.Generator().manual_seed(block_size + hk + head_dim)
    num_blocks, num_tokens = 7, 45
    k_cache = torch.randn(num_blocks, block_size, hk, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hk, head_dim, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::6] = -1  # padding tokens are skipped
    k = strided(torch.randn(num_tokens, hk, head_dim, generator=gen), gen)
    v = strided(torch.randn(num_tokens, hk, head_dim, generator=gen), gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ext.write_kv_cpu(k, v, k_cache, v_cache, slots)
    write_kv_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_bad_input_is_refused_with_a_reason(ext):
    q = torch.randn(2, 4, 32, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 2, 32)
    with pytest.raises(RuntimeError, match="float32"):
        ext.paged_decode_attention_cpu(q, cache, cache, torch.zeros(2, 1, dtype=torch.int32),
                                       torch.ones(2, dtype=torch.int32), 1.0, 0, 0.0)


def test_the_cpu_backend_runs_the_cpp_kernels_for_float32(ext, monkeypatch):
    calls = []

    def spy(name):
        real = getattr(ext, name)

        def wrapped(*args):
            calls.append(name)
            return real(*args)

        return wrapped

    spied = type("Spied", (), {n: staticmethod(spy(n)) for n in cpu.FUNCTIONS})
    monkeypatch.setattr(cpu, "extension", lambda cache_dir=None: spied)
    backend = select_backend("cpu", torch.float32)
    assert isinstance(backend, CpuBackend) and backend.name == "cpu-cpp"
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache, table = paged_cache([9, 30], 16, 2, 32, torch.float32, gen, device="cpu")
    q = torch.randn(2, 4, 32, generator=gen)
    seq_lens = torch.tensor([9, 30], dtype=torch.int32)
    backend.write_kv(q[:, :2], q[:, 2:], k_cache, v_cache, torch.tensor([3, -1]))
    out = backend.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.2)
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k_cache, v_cache, table, seq_lens, 0.2))
    assert calls == ["write_kv_cpu", "paged_decode_attention_cpu"]
    # bf16 on the CPU, or the kernels switched off (cpu_kernels=False), serve through the references
    assert select_backend("cpu", torch.bfloat16).name == "torch-reference"
    off = select_backend("cpu", torch.float32, cpu_kernels_enabled=False)
    assert off.name == "torch-reference"
    off.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.2)
    assert len(calls) == 2


def test_a_failed_build_falls_back_to_the_reference(tmp_path):
    """No compiler: one warning naming the fix, then the references serve. In a child process, because torch's
    extension loader remembers a failed build for the rest of the process."""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-g++"), TOKENBUS_CACHE_DIR=str(tmp_path / "cache"))
    code = ("import torch; from worker.engine.backends import select_backend; "
            "print('BACKEND', select_backend('cpu', torch.float32).name)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "BACKEND torch-reference" in done.stdout
    assert "cpu_kernels_unavailable" in done.stdout + done.stderr and "install g++" in done.stdout + done.stderr


@pytest.mark.parametrize("block_size,hq,hk,head_dim", [(16, 9, 3, 64), (32, 8, 1, 64), (8, 4, 4, 32)])
def test_backend_prefill_matches_reference(ext, block_size, hq, hk, head_dim):
    """CpuBackend's prefill (the C++ prefill kernel; tests/kernels/test_cpu_prefill.py has its own cases):
    chunks after earlier chunks, whole prompts, single tokens and an empty entry, as in the Triton prefill
    test."""
    gen = torch.Generator().manual_seed(block_size + hq + head_dim)
    bs = block_size
    pairs = [(1, 1), (bs - 1, bs - 1), (bs, 3), (bs + 1, bs + 1), (2 * bs, 0), (4 * bs + 7, 1),
             (4 * bs + 7, 2 * bs + 5)]
    k_cache, v_cache, table = paged_cache([c for c, _ in pairs], block_size, hk, head_dim, torch.float32, gen,
                                          device="cpu")
    q, cu_seqlens_q, seq_lens = prefill_inputs(pairs, hq, head_dim, torch.float32, gen, device="cpu")
    out = CpuBackend(ext).prefill_attention(q, k_cache, v_cache, table, cu_seqlens_q, seq_lens, head_dim**-0.5)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, table, cu_seqlens_q, seq_lens, head_dim**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 12, 13, 17, 32, 33, 64, 65, 80])
def test_cpu_linear_matches_f_linear(ext, rows):
    """CpuLinear: the panel kernel up to PANEL_MAX_ROWS rows, oneDNN beyond; both equal F.linear (fp32, other
    summation order). Awkward widths: out not a multiple of 16, a bias, x rows strided (a slice)."""
    from worker.engine.backends.cpu_linear import PANEL_MAX_ROWS, CpuLinear

    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(200, 77, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(77, 200, generator=gen) * 0.05)
        linear.bias.copy_(torch.randn(77, generator=gen))
    wide = torch.randn(rows, 250, generator=gen)
    x = wide[:, 25:225]
    cpu_linear = CpuLinear(linear, ext)
    calls = count_calls(cpu_linear, "panel_linear_cpu")
    with torch.inference_mode():
        out = cpu_linear(x)
        expected = torch.nn.functional.linear(x, linear.weight, linear.bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert calls == ([rows] if rows <= PANEL_MAX_ROWS else [])


@pytest.mark.parametrize("rows", [3, 64, 65, 300])
def test_cpu_backend_fused_gelu_and_add(ext, rows):
    """An encoder's linear + GELU and linear + residual (CpuBackend.linear_gelu / linear_add): oneDNN's post-ops
    past PANEL_MAX_ROWS rows, the panel kernel and the ops apart below; either way the reference backend's
    gelu(F.linear) and F.linear + residual. Awkward widths, a bias."""
    from worker.engine.backends import CpuBackend, ReferenceBackend
    from worker.engine.backends.cpu_linear import PANEL_MAX_ROWS, CpuLinear

    gen = torch.Generator().manual_seed(rows + 1)
    linear = torch.nn.Linear(200, 77, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(77, 200, generator=gen) * 0.05)
        linear.bias.copy_(torch.randn(77, generator=gen))
    x, residual = torch.randn(rows, 200, generator=gen), torch.randn(rows, 77, generator=gen)
    fast, ref, cpu_linear = CpuBackend(ext), ReferenceBackend(), CpuLinear(linear, ext)
    fused = cpu_linear.fused(x, "gelu")
    assert (fused is None) == (rows <= PANEL_MAX_ROWS)  # the post-op path is taken where oneDNN runs
    with torch.inference_mode():
        torch.testing.assert_close(fast.linear_gelu(cpu_linear, x), ref.linear_gelu(linear, x), rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(fast.linear_add(cpu_linear, x, residual), ref.linear_add(linear, x, residual),
                                   rtol=1e-5, atol=1e-5)
        assert not torch.equal(fast.linear_gelu(cpu_linear, x), cpu_linear(x))  # the GELU was applied


def test_panel_kernel_every_tile_height(ext):
    """The panel kernel has one loop per tile height (1-16 rows with AVX-512, 1-6 with AVX2) and reads a panel
    again per tile: every row count up to 70 against F.linear, in_features not a multiple of its prefetch
    distance."""
    from worker.engine.backends.cpu_linear import pack_panels

    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(45, 1100, generator=gen) * 0.03
    panels = pack_panels(weight)
    for rows in range(1, 71):
        x = torch.randn(rows, 1100, generator=gen)
        out = ext.panel_linear_cpu(x, panels, 45, None)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, rows=rows: f"{rows} rows: {m}")


def test_the_kernel_switch_reaches_the_engine_in_its_config():
    """`--cpu-kernels false` travels in the EngineConfig the settings build (no environment variable read at
    import), and parsing the worker's settings imports neither torch nor the kernels."""
    code = ("import sys, worker.__main__ as m; c = m.load_settings(['--cpu-kernels', 'false']).engine; "
            "print('CONFIG', c.cpu_kernels, 'IMPORTED', 'torch' in sys.modules or 'tokenbus_kernels' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "CONFIG False IMPORTED False" in done.stdout


@pytest.mark.parametrize("rows,vocab", [(0, 5), (1, 1), (3, 17), (64, 49152)])
def test_argmax_rows_matches_torch(ext, rows, vocab):
    """The greedy sampler's argmax: the first maximum of each row, like torch.argmax, with ties, -inf (banned
    tokens) and rows that are a strided slice of a wider tensor."""
    from worker.engine.backends import CpuBackend

    gen = torch.Generator().manual_seed(rows * 1000 + vocab)
    wide = torch.randn(rows, vocab + 3, generator=gen)
    logits = wide[:, 2 : 2 + vocab]
    if rows and vocab > 2:
        logits[0, 1:] = logits[0, 0]  # a row of ties: index 0
        logits[-1, vocab // 2] = logits[-1, vocab - 1] = logits[-1].max() + 1  # two maxima: the first wins
        logits[rows // 2, : vocab - 1] = float("-inf")  # all but one token banned
    out = ext.argmax_rows_cpu(logits)
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(dim=-1))
    assert torch.equal(CpuBackend(ext).argmax(logits), logits.argmax(dim=-1))

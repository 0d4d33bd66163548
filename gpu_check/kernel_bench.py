#!/usr/bin/env python
"""Correctness, then speed, of the Triton paged-attention kernels on one CUDA GPU.

    .venv/bin/python -m gpu_check.kernel_bench  # H200: a few minutes; rewrites the table in docs/kernels.md
    .venv/bin/python -m gpu_check.kernel_bench --cpu-smoke  # no GPU: the correctness part, tiny shapes, interpreter

1. Correctness: every kernel against tokenbus_kernels/reference.py on random inputs with awkward lengths.
2. Speed (bf16, block_size 16, shuffled block tables), triton.testing.do_bench, for a 0.5B-class shape
   (14 q / 2 kv heads, head_dim 64) and a 7B-class shape (32 / 8, 128) over batch x context:
   - decode: KV bytes read / time against a measured device-to-device copy bandwidth; PyTorch SDPA on the
     same KV already gathered into dense [batch, kv_heads, context, head_dim] tensors (gather not timed);
   - prefill: a chunk of min(context, 512) new tokens per sequence on top of its cached context, TFLOP/s,
     against SDPA with a lower-right causal mask on gathered KV;
   - write_kv: one decode step's K/V rows.
   Target: decode >= 80% of copy bandwidth at batch >= 64 and context >= 2k.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "kernels.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
SHAPES = {"0.5B": (14, 2, 64), "7B": (32, 8, 128)}  # name: (q heads, kv heads, head_dim)
BATCHES = (1, 16, 64, 256)
CONTEXTS = (128, 2048, 16384)
PREFILL_CHUNK = 512
BLOCK_SIZE = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="only the correctness part, tiny shapes, on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite the table in docs/kernels.md")
    return parser.parse_args()


def paged_inputs(torch, lens, block_size, hk, d, dtype, device, gen):
    """Random caches with junk beyond every context, shuffled block tables, seq_lens."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    k_cache = torch.randn(num_blocks, block_size, hk, d, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hk, d, generator=gen, device=device).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = ids[used : used + n]
        used += n
    return k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32, device=device)


def check_correctness(torch, device: str, cases) -> list[tuple[str, float, bool]]:
    """Each kernel against its reference; returns (case, max abs error, within tolerance)."""
    from tokenbus_kernels.decode_attention import paged_decode_attention_triton
    from tokenbus_kernels.kv_write import write_kv_triton
    from tokenbus_kernels.prefill_attention import paged_prefill_attention_triton
    from tokenbus_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, write_kv_ref

    tol = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1e-2)}
    results = []
    gen = torch.Generator(device=device).manual_seed(0)
    for dtype, (hq, hk, d), block_size, lens, partition in cases:
        rtol, atol = tol[dtype]
        name = f"{str(dtype)[6:]} {hq}/{hk}x{d} bs{block_size} lens{lens[:3]}.. p{partition}"
        k_cache, v_cache, table, seq_lens = paged_inputs(torch, lens, block_size, hk, d, dtype, device, gen)
        scale = d**-0.5

        def record(kind, out, ref, name=name, rtol=rtol, atol=atol):
            err = (out.float() - ref.float()).abs()
            ok = not out.isnan().any().item() and bool((err <= atol + rtol * ref.float().abs()).all().item())
            results.append((f"{kind:8s} {name}", err.max().item(), ok))

        q = torch.randn(len(lens), hq, d, generator=gen, device=device).to(dtype)
        out = torch.full_like(q, float("nan"))
        paged_decode_attention_triton(q, k_cache, v_cache, table, seq_lens, scale, out=out, partition_size=partition)
        record("decode", out, paged_decode_attention_ref(q, k_cache, v_cache, table, seq_lens, scale))

        q_lens = [max(1, n // 3) for n in lens]
        cu = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
        q = torch.randn(sum(q_lens), hq, d, generator=gen, device=device).to(dtype)
        out = torch.full_like(q, float("nan"))
        paged_prefill_attention_triton(q, k_cache, v_cache, table, cu, seq_lens, scale, out=out)
        record("prefill", out, paged_prefill_attention_ref(q, k_cache, v_cache, table, cu, seq_lens, scale))

        slots = torch.randperm(k_cache.shape[0] * block_size, generator=gen, device=device)[: len(lens) * 4]
        slots[::5] = -1
        k = torch.randn(len(slots), hk, d, generator=gen, device=device).to(dtype)
        v = torch.randn_like(k)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        write_kv_triton(k, v, k_cache, v_cache, slots)
        write_kv_ref(k, v, k_ref, v_ref, slots)
        record("write_kv", torch.cat([k_cache, v_cache]), torch.cat([k_ref, v_ref]))
    return results


def correctness_cases(torch, smoke: bool):
    if smoke:
        return [
            (torch.float32, SHAPES["0.5B"], 16, [1, 15, 16, 17, 70], 32),
            (torch.bfloat16, (8, 2, 32), 32, [1, 31, 33, 90], None),
        ]
    lens = [1, 15, 16, 17, 1000, 5000]
    cases = [(torch.bfloat16, shape, bs, lens, part) for shape in SHAPES.values() for bs in (16, 64)
             for part in (None, 256)]
    cases += [(dt, (12, 4, 256), 32, lens, None) for dt in (torch.float16, torch.float32)]
    cases += [(torch.float32, SHAPES["7B"], 16, lens, 512), (torch.float16, (16, 1, 32), 16, lens, None)]
    return cases


def copy_bandwidth(torch, do_bench) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300)
    return 2 * src.numel() / (ms * 1e-3)


def sdpa_ms(torch, do_bench, q, k, v, mask=None) -> float | None:
    """SDPA (flash / mem-efficient only, never the quadratic-memory math path) on dense KV, or None."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            return do_bench(lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True))
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        print(f"  sdpa unavailable: {str(exc).splitlines()[0][:100]}")
        return None


def bench_config(torch, do_bench, name, shape, batch, ctx, copy_bw):
    """One row: (shape, batch, context, decode us, GB/s, % copy, SDPA us, prefill us, TFLOP/s, SDPA us)."""
    from torch.nn.attention.bias import causal_lower_right

    from tokenbus_kernels.decode_attention import paged_decode_attention_triton
    from tokenbus_kernels.prefill_attention import paged_prefill_attention_triton

    hq, hk, d = shape
    dtype, dev = torch.bfloat16, "cuda"
    el = torch.tensor([], dtype=dtype).element_size()
    scale = d**-0.5
    blocks_per_seq = ctx // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, hk, d, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_blocks, device=dev).to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
    dec_ms = do_bench(partial(paged_decode_attention_triton, q, k_cache, v_cache, table, seq_lens, scale))
    kv_bytes = 2 * batch * ctx * hk * d * el + 2 * q.numel() * el
    gbps = kv_bytes / (dec_ms * 1e-3) / 1e9

    # dense [batch, kv_heads, ctx, d] copies of the same KV for SDPA (the gather is not timed)
    k_dense = k_cache[table.long()].reshape(batch, ctx, hk, d).transpose(1, 2).contiguous()
    v_dense = v_cache[table.long()].reshape(batch, ctx, hk, d).transpose(1, 2).contiguous()
    sdpa_dec = sdpa_ms(torch, do_bench, q.unsqueeze(2), k_dense, v_dense)

    chunk = min(ctx, PREFILL_CHUNK)
    qp = torch.randn(batch * chunk, hq, d, device=dev, dtype=dtype)
    cu = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * chunk
    pre_ms = do_bench(partial(paged_prefill_attention_triton, qp, k_cache, v_cache, table, cu, seq_lens, scale))
    # the chunk ends the context: its query j sees ctx - chunk + j + 1 keys
    visible = batch * (chunk * (ctx - chunk) + chunk * (chunk + 1) // 2)
    tflops = 4 * visible * hq * d / (pre_ms * 1e-3) / 1e12
    q_dense = qp.view(batch, chunk, hq, d).transpose(1, 2)
    sdpa_pre = sdpa_ms(torch, do_bench, q_dense, k_dense, v_dense, causal_lower_right(chunk, ctx))
    print(f"  {name} batch {batch:3d} ctx {ctx:5d}: decode {dec_ms * 1e3:8.1f} us {gbps:6.0f} GB/s, "
          f"prefill {pre_ms * 1e3:9.1f} us {tflops:6.1f} TFLOP/s", flush=True)
    return (name, batch, ctx, dec_ms * 1e3, gbps, 100 * gbps * 1e9 / copy_bw,
            None if sdpa_dec is None else sdpa_dec * 1e3, pre_ms * 1e3, tflops,
            None if sdpa_pre is None else sdpa_pre * 1e3)


def bench_write_kv(torch, do_bench):
    from tokenbus_kernels.kv_write import write_kv_triton

    lines = []
    for name, (_, hk, d) in SHAPES.items():
        for tokens in (64, 4096):
            k_cache = torch.randn(4096, BLOCK_SIZE, hk, d, device="cuda", dtype=torch.bfloat16)
            v_cache = torch.randn_like(k_cache)
            slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, device="cuda")[:tokens]
            k = torch.randn(tokens, hk, d, device="cuda", dtype=torch.bfloat16)
            ms = do_bench(partial(write_kv_triton, k, k, k_cache, v_cache, slots))
            moved = 4 * k.numel() * k.element_size()  # read k, v; write both
            lines.append(f"| {name} | {tokens} | {ms * 1e3:.1f} | {moved / (ms * 1e-3) / 1e9:.0f} |")
    return lines


def fmt(value, spec):
    return "n/a" if value is None else format(value, spec)


def tables(rows, copy_bw, device_name, write_lines) -> str:
    target = [r for r in rows if r[1] >= 64 and r[2] >= 2048]
    worst = min(r[5] for r in target)
    out = [
        f"Device: {device_name}; bf16; block_size {BLOCK_SIZE}; measured copy bandwidth "
        f"{copy_bw / 1e9:.0f} GB/s (read + write).",
        f"Decode target (>= 80% of copy bandwidth at batch >= 64, context >= 2k): "
        f"{'met' if worst >= 80 else 'NOT met'} (worst {worst:.0f}%).",
        "",
        f"Prefill: a chunk of min(context, {PREFILL_CHUNK}) new tokens per sequence; SDPA gets the same KV "
        "gathered dense (gather not timed).",
        "",
        "| shape | batch | context | prefill us | TFLOP/s | SDPA us | SDPA / ours |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = None if r[9] is None else r[9] / r[7]
        out.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[7]:.1f} | {r[8]:.1f} | {fmt(r[9], '.1f')} | "
                   f"{fmt(ratio, '.2f')} |")
    out += ["", "write_kv (one call):", "", "| shape | tokens | us | GB/s |", "|---|---:|---:|---:|", *write_lines]
    out += ["", "Decode (KV bytes read / time):", "",
            "| shape | batch | context | decode us | GB/s | % copy BW | SDPA us | SDPA / ours |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = None if r[6] is None else r[6] / r[3]
        out.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.0f} | {r[5]:.0f} | {fmt(r[6], '.1f')} | "
                   f"{fmt(ratio, '.2f')} |")
    return "\n".join(out)


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        print(f"{DOC} has no {BEGIN} ... {END} section; table not written")
        return
    head, rest = doc.split(BEGIN, 1)
    DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")
    print(f"table written to {DOC}")


def report(results) -> bool:
    for case, err, ok in results:
        print(f"  {'ok  ' if ok else 'FAIL'} {case}  max abs err {err:.2e}")
    return all(ok for _, _, ok in results)


def main() -> int:
    args = parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernels module defines its @triton.jit functions
    import torch

    if args.cpu_smoke:
        print("correctness (CPU, Triton interpreter):")
        return 0 if report(check_correctness(torch, "cpu", correctness_cases(torch, smoke=True))) else 1
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device here; this benchmark needs an NVIDIA GPU "
              "(use --cpu-smoke for the interpreter correctness check)", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    device_name = torch.cuda.get_device_name()
    print(f"correctness ({device_name}):")
    if not report(check_correctness(torch, "cuda", correctness_cases(torch, smoke=False))):
        print("correctness FAILED: no timings")
        return 1
    copy_bw = copy_bandwidth(torch, do_bench)
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s")
    rows = []
    for name, shape in SHAPES.items():
        for ctx in CONTEXTS:
            for batch in BATCHES:
                rows.append(bench_config(torch, do_bench, name, shape, batch, ctx, copy_bw))
                torch.cuda.empty_cache()
    text = tables(rows, copy_bw, device_name, bench_write_kv(torch, do_bench))
    if not args.no_doc:
        write_doc(text)
    print()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

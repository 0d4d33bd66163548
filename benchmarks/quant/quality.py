"""Quality of the weight quantization schemes and the KV-cache dtypes against the unquantized model (issue 24),
SmolLM2-135M's real weights (the built-in GGUF, dequantized to fp32), CPU:

  perplexity   on a fixed held-out text (benchmarks/quant_heldout.txt: a snapshot of this project's
               docs/architecture.md, written after SmolLM2 was trained), in windows of 512 tokens, through
               transformers with each linear's weight replaced by its quantized-dequantized value: the model
               the tokenbus engine serves (tests/engine/test_quantization.py: token for token equal); a KV
               dtype ("kv int8", "kv bf16") instead rounds each layer's rotated keys and its values as the
               cache stores them (tokenbus_kernels/kv_quant.py: per token and KV head) before attention, which is
               what the engine's attention reads back; w8a8 also rounds each linear's input per token to
               int8 per group of 64 features (quantization.round_activations_int8, a forward pre-hook), as its
               kernel quantizes it;
  greedy       64 chat prompts (bench/workload.py), 64 new tokens each, EOS ignored, through the
  agreement    tokenbus engine, fp32 against the scheme: the share of requests whose tokens are identical,
               and the share of tokens before the first divergence (mean over requests).

fp8 is the GPU scheme (e4m3 weights per channel, activations per token): here both measures run its
definition, tokenbus_kernels/fp8_linear.py's fp8_linear_reference, in fp32 — for perplexity in transformers' linears
(lm_head kept, as the engine keeps it), for greedy agreement in the engine's Fp8Linears (PyTorch's CPU
torch._scaled_mm computes the same within fp32 rounding, tests/kernels/test_fp8_linear.py, but is far too
slow on the CPU for 64 prompts). The GPU's bf16 activations and outputs are not modelled.

    .venv/bin/python -m benchmarks.quant.quality              # ~5 min on 2 cores; writes docs/quantization.md
    .venv/bin/python -m benchmarks.quant.quality --no-write --num-prompts 4 --max-tokens 8   # smoke
    .venv/bin/python -m benchmarks.quant.quality --no-write --no-greedy --schemes int8,w8a8 --heldout-tokens 1536
"""

from __future__ import annotations

import math
import os
import time
from functools import partial

import torch

from bench.harness import parser
from bench.workload import chat_ids, workload
from benchmarks.harness.docs import write_section
from tokenbus_kernels.fp8_linear import fp8_linear_reference, quantize_weight
from worker.engine.quant.schemes import quantize_int8, round_activations_int8

HELDOUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heldout.txt")
WINDOW = 512
SCHEMES = ("int8", "w8a8", "fp8", "kv bf16", "kv int8")  # weights; KV-cache dtypes (--kv-cache-dtype), fp32 weights


def _kv_attention(dtype: torch.dtype):
    """transformers' sdpa attention over keys and values rounded as a `dtype` KV cache holds them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tokenbus_kernels.kv_quant import dequantize, quantize

    def stored(x: torch.Tensor) -> torch.Tensor:  # [batch, kv heads, tokens, head_dim]: a scale per row
        return dequantize(quantize(x, dtype)) if dtype == torch.int8 else x.to(dtype).float()

    def attention(module, query, key, value, *args, **kwargs):
        return sdpa_attention_forward(module, query, stored(key), stored(value), *args, **kwargs)

    return attention


@torch.inference_mode()
def perplexity(model, ids: list[int]) -> float:
    """exp(mean NLL) over non-overlapping windows of WINDOW tokens (each window's first token unscored)."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        window = torch.tensor([ids[start : start + WINDOW]])
        if window.shape[1] < 2:
            break
        logits = model(window).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum").item()
        count += window.shape[1] - 1
    return math.exp(nll / count)


def quantized_hf(directory: str, scheme: str):
    from transformers import AutoModelForCausalLM

    if scheme.startswith("kv "):
        from transformers import AttentionInterface

        name = "tokenbus_" + scheme.replace(" ", "_")
        AttentionInterface.register(name, _kv_attention({"kv bf16": torch.bfloat16, "kv int8": torch.int8}[scheme]))
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation=name).eval()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    if scheme == "fp32":
        return model
    if scheme == "fp8":  # every linear but lm_head computes the FP8 reference
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                qweight, w_scale = quantize_weight(module.weight)
                module.forward = partial(fp8_linear_reference, qweight=qweight, w_scale=w_scale, bias=module.bias)
        return model
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untie
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(quantize_int8(module.weight).dequantize())
                if scheme == "w8a8":  # and each linear's input rounded per token to int8, as the kernel does
                    module.register_forward_pre_hook(lambda _m, args: (round_activations_int8(args[0]), *args[1:]))
    return model


def greedy_outputs(scheme: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from worker import Engine, SamplingParams

    kv = scheme.removeprefix("kv ") if scheme.startswith("kv ") else "auto"
    engine = Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=64, kv_cache_dtype=kv,
                    quantization=scheme if scheme in ("int8", "w8a8", "fp8") else None)
    if scheme == "fp8":  # the engine's FP8 linears on their fp32 reference (the module docstring says why)
        from worker.engine.quant.fp8 import Fp8Linear

        for m in engine.model.modules():
            if isinstance(m, Fp8Linear):
                m.forward = partial(fp8_linear_reference, qweight=m.weight, w_scale=m.weight_scale, bias=m.bias)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of identical requests, mean share of tokens before the first divergence)."""
    identical, prefix = 0, 0.0
    for out, ref in zip(outputs, reference, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), min(len(out), len(ref)))
        identical += out == ref
        prefix += n / max(len(ref), 1)
    return identical / len(reference), prefix / len(reference)


def main() -> None:
    ap = parser(__doc__, prompts=64, max_tokens=64, docs=True)
    ap.add_argument("--no-perplexity", action="store_true", help="greedy agreement only (a loaded machine)")
    ap.add_argument("--no-greedy", action="store_true", help="perplexity only (no engine runs)")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help=f"a comma-separated subset of {SCHEMES}")
    ap.add_argument("--section", default="quality", help="the docs/quantization.md section to write")
    ap.add_argument("--heldout-tokens", type=int, default=0, help="score only the first N tokens (0 = all)")
    args = ap.parse_args()
    schemes_run = tuple(s for s in args.schemes.split(",") if s)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    from worker.engine import loader

    source = loader.resolve("smollm2-135m")
    tokenizer = loader.load_tokenizer(source)
    ids = tokenizer(open(HELDOUT).read())["input_ids"]
    ids = ids[: args.heldout_tokens] if args.heldout_tokens else ids
    prompts = chat_ids(tokenizer, workload(args.num_prompts))
    started = time.strftime("%Y-%m-%d %H:%M")
    schemes = () if args.no_perplexity else ("fp32", *schemes_run)
    ppl = {s: perplexity(quantized_hf(source.directory, s), ids) for s in schemes}
    ppl = {s: ppl.get(s, math.nan) for s in ("fp32", *schemes_run)}
    reference = None if args.no_greedy else greedy_outputs("fp32", prompts, args.max_tokens)
    rows = [f"| fp32 | {ppl['fp32']:.3f} | — | 100 % | 100 % |"]
    for scheme in schemes_run:
        same, prefix = (math.nan, math.nan) if reference is None else agreement(
            greedy_outputs(scheme, prompts, args.max_tokens), reference)
        delta = ppl[scheme] / ppl["fp32"] - 1
        rows.append(f"| {scheme} | {ppl[scheme]:.3f} | {delta:+.2%} | {same:.1%} | {prefix:.1%} |")
    body = "\n".join([
        f"SmolLM2-135M-Instruct (the built-in GGUF, dequantized to fp32), CPU; perplexity over {len(ids)} tokens "
        f"of benchmarks/quant_heldout.txt in windows of {WINDOW}; greedy agreement over {len(prompts)} chat "
        f"prompts × {args.max_tokens} tokens (EOS ignored) through the engine; run {started} with "
        "`python -m benchmarks.quant.quality`.",
        "",
        "| scheme | perplexity | vs fp32 | identical requests | tokens before first divergence |",
        "|---|---|---|---|---|",
        *rows,
    ])
    print(body)
    if not args.no_write:
        write_section("quantization.md", args.section, body)


if __name__ == "__main__":
    main()

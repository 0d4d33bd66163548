"""One staggered mixed batch of embedding (and generation) requests, shared by the embedding tests: inputs of
every length (one token to several times the step's token budget: chunked prefill for a decoder, a whole step of
its own for an encoder), texts that extend earlier ones (shared prefixes: prefix-cache hits where the pooling may
read them), a token-id input, a Matryoshka `dimensions` request, arrivals spread over steps, and, where the model
generates too, greedy generation requests in the same engine (one starting with an embedded input's tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

WORDS = ("queue stream worker token batch vector engine model kernel cache block prefix chunk budget pool mean "
         "last norm query key value layer head step").split()


def words(n: int, seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (n,), generator=gen).tolist())


# the first text is past the tiny engines' 32-token budget; the third and fifth extend the first
TEXTS = [words(60, 1), "hi", words(60, 1) + " " + words(12, 2), words(25, 3), words(60, 1) + " " + words(30, 4),
         words(7, 5), words(40, 6)]


@dataclass
class Request:
    arrival: int  # the step before which it is added
    prompt: Any  # text or token ids
    params: Any  # EmbedParams or SamplingParams
    expect_text: int | None = None  # embeddings: the TEXTS entry whose sentence-transformers vector it must equal


@dataclass
class Batch:
    requests: dict[str, Request] = field(default_factory=dict)


def mixed_batch(tokenizer: Any, generation: bool, dims: int) -> Batch:
    from worker.engine.pooling import EmbedParams
    from worker.engine.sampling_params import SamplingParams

    batch = Batch()
    for i, text in enumerate(TEXTS):
        batch.requests[f"e{i}"] = Request(arrival=[0, 0, 2, 1, 4, 3, 5][i], prompt=text, params=EmbedParams(),
                                          expect_text=i)
    batch.requests["ids"] = Request(2, tokenizer.encode(TEXTS[3]), EmbedParams(), expect_text=3)
    batch.requests["dims"] = Request(1, TEXTS[6], EmbedParams(dimensions=dims), expect_text=6)
    if generation:
        greedy = dict(temperature=0.0, ignore_eos=True)
        batch.requests["g0"] = Request(0, tokenizer.encode(TEXTS[5])[:6], SamplingParams(max_tokens=9, **greedy))
        # starts with an embedded input's full blocks: generation reads the cache an embedding wrote
        batch.requests["g1"] = Request(3, tokenizer.encode(TEXTS[0]) + [7, 8, 9], SamplingParams(max_tokens=6,
                                                                                                   **greedy))
    return batch


def run(engine: Any, batch: Batch) -> dict[str, Any]:
    """Every request through `engine`, added at its arrival step; returns the outputs by request id."""
    outputs: dict[str, Any] = {}
    step = 0
    while len(outputs) < len(batch.requests):
        for rid, req in batch.requests.items():
            if req.arrival == step:
                engine.add_request(rid, req.prompt, req.params)
        for out in engine.step():
            outputs[out.request_id] = out
        step += 1
        assert step < 500, "the batch did not finish"
    return outputs


def st_vectors(directory: str) -> torch.Tensor:
    """sentence-transformers' own vectors of TEXTS (float32), the reference."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(directory, device="cpu")
    return torch.from_numpy(model.encode(TEXTS, batch_size=4, convert_to_numpy=True)).float()


def check_vectors(outputs: dict[str, Any], batch: Batch, reference: torch.Tensor, normalized: bool) -> None:
    """Each embedding equals its sentence-transformers vector (max abs diff <= 1e-5, else cosine >= 0.99999);
    the `dimensions` one equals the reference's prefix, renormalized."""
    for rid, req in batch.requests.items():
        if req.expect_text is None:
            continue
        want = reference[req.expect_text]
        dims = req.params.dimensions
        if dims is not None:
            want = want[:dims]
            want = want / want.norm() if normalized else want
        got = outputs[rid].embedding
        assert got is not None and got.dtype == torch.float32 and got.shape == want.shape, rid
        diff = (got - want).abs().max().item()
        cosine = torch.nn.functional.cosine_similarity(got, want, dim=0).item()
        assert diff <= 1e-5 or cosine >= 0.99999, f"{rid}: max abs diff {diff}, cosine {cosine}"
        assert outputs[rid].finish_reason == "stop" and outputs[rid].token_ids == []

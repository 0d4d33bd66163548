"""Whose fault a failed job is (worker/engine/errors.py): the engine's typed errors reach the job record as
its code. InvalidRequest is the client's (its own code, "invalid job: ..."); an EngineFault, or anything else
the engine raises, is the worker's (worker_error, "worker error: ..."). Real tiny engine, real redis-server;
the faults are injected into the engine's own parts."""

from __future__ import annotations

import dataclasses

from producer import Client


def submit(client: Client, prompt: str, **fields) -> str:
    return client.submit(prompt, max_tokens=4, temperature=0.0, **fields)


def test_a_grammar_over_the_cpu_budget_fails_with_its_code(serve_engine, serve, redis_server, monkeypatch):
    # Every first mask goes over a budget below zero: the compile refuses the grammar with code
    # grammar_too_costly, and the server reads that code from the engine's rejection (not from its text).
    guided = serve_engine.guided
    monkeypatch.setattr(guided, "limits", dataclasses.replace(guided.limits, mask_budget_ms=-1.0))
    client = Client(redis_server.url)
    costly = submit(client, "digits", regex="[0-9]{1,7}")
    good = [submit(client, f"good {i}") for i in range(3)]
    handle = serve(serve_engine)
    jobs = {j.id: j for j in client.as_completed([costly, *good], timeout=120)}
    assert jobs[costly].status == "failed" and jobs[costly].error_code == "grammar_too_costly", jobs[costly]
    assert jobs[costly].error.startswith("invalid job: ") and "mask_budget_ms" in jobs[costly].error
    assert all(jobs[g].status == "finished" for g in good)
    assert handle.stop() == 0


def test_a_grammar_compile_that_breaks_is_the_workers_fault(serve_engine, serve, redis_server, monkeypatch):
    def broken_compile(grammar: str):
        raise RuntimeError("simulated llguidance crash")

    monkeypatch.setattr(serve_engine.guided, "_compile", broken_compile)
    client = Client(redis_server.url)
    broken = submit(client, "letters", regex="[a-f]{1,9}")  # a grammar no other test compiled (the cache)
    good = submit(client, "good")
    handle = serve(serve_engine)
    jobs = {j.id: j for j in client.as_completed([broken, good], timeout=120)}
    assert jobs[broken].status == "failed" and jobs[broken].error_code == "worker_error", jobs[broken]
    assert jobs[broken].error.startswith("worker error: ") and "simulated llguidance crash" in jobs[broken].error
    assert jobs[good].status == "finished"
    assert handle.stop() == 0


def test_an_engine_fault_at_add_request_is_never_the_clients(serve_engine, serve, redis_server, monkeypatch):
    tokenizer = serve_engine.tokenizer
    real_encode = tokenizer.encode

    def encode(text, *args, **kwargs):
        if "explode" in text:
            raise RuntimeError("simulated tokenizer fault")
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)
    client = Client(redis_server.url)
    faulty = submit(client, "explode here")
    too_long = client.submit("hi", max_tokens=10**5)  # the model's context is far shorter: the client's fault
    good = submit(client, "good")
    handle = serve(serve_engine)
    jobs = {j.id: j for j in client.as_completed([faulty, too_long, good], timeout=120)}
    assert jobs[faulty].status == "failed" and jobs[faulty].error_code == "worker_error", jobs[faulty]
    assert "EngineFault" in jobs[faulty].error and "simulated tokenizer fault" in jobs[faulty].error
    assert jobs[too_long].status == "failed" and jobs[too_long].error_code == "invalid_request", jobs[too_long]
    assert "exceeds the model context" in jobs[too_long].error
    assert jobs[good].status == "finished"
    assert handle.stop() == 0

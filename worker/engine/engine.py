"""The engine: requests in, one forward pass per step over every running sequence, results out as each ends.

    add_request ──▶ Scheduler.schedule ──▶ ModelRunner.run (model + backend kernels, Sampler, Pooler)
                         ▲                                │
                         └──── Scheduler.postprocess ◀────┘  tokens, text, stops, vectors; finished ones leave

A request is a generation (SamplingParams) or an embedding (EmbedParams: embedding.py, pooling.py); one engine
serves both when its model can: a decoder with an LM head does, an encoder (bert.py) only embeds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence as Seq
from typing import Any

import structlog
import torch

from protocol.priority import Priority, rank_of
from worker.engine import loader, model_setup, offline, pooling, prompts
from worker.engine.block_manager import BlockManager
from worker.engine.cascade import CascadePlanner
from worker.engine.config import EngineConfig, bulk_min_seats
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.embedding import embeddings_for, refuse_kind
from worker.engine.errors import EngineError, EngineFault, InvalidRequest, fault
from worker.engine.guided import GuidedDecoding
from worker.engine.outputs import Choice, EngineStats, RequestOutput, StepDeltas
from worker.engine.overlap import Overlap
from worker.engine.parallel import sharded_loading
from worker.engine.parallel.launch import TensorParallel
from worker.engine.pooling import EmbedParams
from worker.engine.sampler import Sampler
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import ScheduledBatch, Scheduler
from worker.engine.sequence import Sequence
from worker.engine.stop_checker import StopChecker

log = structlog.get_logger("tokenbus.engine")

Prompt = str | list[int] | list[dict[str, Any]]


class Engine:
    def __init__(self, model: str | EngineConfig = "smollm2-135m", **options: Any) -> None:
        """Engine(EngineConfig(...)) or Engine(model, device=..., dtype=..., any other EngineConfig field)."""
        if isinstance(model, EngineConfig):
            if options:
                raise TypeError("give an EngineConfig or keyword options, not both")
            self.config = model
        else:
            self.config = EngineConfig(model=model, **options)
        cfg = self.config
        started = time.perf_counter()
        self.device = model_setup.resolve_device(cfg.device)
        spec = model_setup.resolve(cfg, self.device)
        self.dtype, self.max_model_len, arch = spec.dtype, spec.max_model_len, spec.arch
        self.model_path = spec.model_path  # "native" or "transformers"
        self.causal = getattr(arch, "causal", True)  # False: an encoder (bidirectional attention, embeddings only)
        self.model_name = cfg.model
        self.checkpoint = loader.checkpoint_id(cfg.model, spec.hf_config)  # which weights (the registry's check)
        self.tokenizer = loader.load_tokenizer(spec.source)
        self.eos_token_ids = loader.load_generation_eos(spec.source, spec.hf_config, self.tokenizer)
        # tensor parallelism (worker/engine/parallel/): this process is rank 0; the other ranks start here
        self.parallel: TensorParallel | None = None
        if cfg.tensor_parallel_size > 1:
            shard = sharded_loading.check_shardable(spec.source, arch, self.model_path, spec.hf_config,
                                                    cfg.tensor_parallel_size, cfg.quantization)
            self.parallel = TensorParallel(cfg, shard, self.device)
        try:
            self._set_up(cfg, spec)
        except BaseException:
            if self.parallel is not None:
                self.parallel.abort()
            raise
        self.requests: dict[str, Sequence] = {}  # choice 0 of every request inside
        self.choices: dict[str, list[Sequence]] = {}  # all n choices of every request inside
        # choices 1.. of an n > 1 request wait here until choice 0 has computed (and so cached) the prompt:
        # then they take its full blocks from the prefix cache, a fork without copying
        self.forks: dict[str, list[Sequence]] = {}
        self.deltas = StepDeltas()
        self.rejected: dict[str, EngineError] = {}  # request id -> why (its code): left in the last step, never ran
        self.generated_tokens = 0
        self.steps = 0
        # overlap (overlap.py): the next step is scheduled and prepared while the device runs this one
        overlap = cfg.overlap if cfg.overlap is not None else (
            self.device.type == "cuda" or os.environ.get("TOKENBUS_OVERLAP") == "1")  # the env: test suites
        self.overlap = Overlap(self.scheduler, self.runner, self.guided, self.finish_step) if overlap else None
        log.info(
            "engine_ready", model=cfg.model, device=str(self.device), dtype=str(self.dtype),
            kv_blocks=self.block_manager.num_blocks, tensor_parallel_size=cfg.tensor_parallel_size,
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            block_size=cfg.block_size, max_model_len=self.max_model_len, backend=self.backend.name,
            max_num_seqs=self.max_num_seqs, static_decode=self.static_decode, cuda_graphs=self.cuda_graphs,
            model_path=self.model_path, overlap=overlap, load_s=round(time.perf_counter() - started, 2),
            kinds=self.kinds, pooling=self.embeddings.pooling.mode if self.embeddings else None,
        )

    @property
    def kinds(self) -> list[str]:
        """The request kinds this engine serves: "generate", "embed" or both."""
        return [kind for kind, ok in (("generate", self.can_generate), ("embed", self.embeddings is not None)) if ok]

    def _set_up(self, cfg: EngineConfig, spec: model_setup.ModelSpec) -> None:
        """The model, its KV cache, the scheduler and the sampler (on every rank's side: model_setup.py)."""
        tp = self.parallel.group if self.parallel is not None else None
        setup = model_setup.set_up(cfg, self.device, spec, tp)
        self.model, self.backend, self.kv_dtype = setup.model, setup.backend, setup.kv_dtype
        self.quantized_cache, self.max_num_seqs, self.cuda_graphs = setup.quantized_cache, setup.max_num_seqs, \
            setup.cuda_graphs
        self.block_manager = BlockManager(setup.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        # the step channel does not carry a cascade layout to the other ranks yet: off under tensor parallelism
        self.cascade = CascadePlanner(self.block_manager, cfg.cascade_attention if self.parallel is None else "off")
        self.stop_checker = StopChecker(self.eos_token_ids)
        self.guided = GuidedDecoding(self.tokenizer, spec.arch.vocab_size, self.eos_token_ids, self.device)
        self.scheduler = Scheduler(self.block_manager, self.stop_checker, self.max_num_seqs,
                                   cfg.max_num_batched_tokens, self.guided,
                                   bulk_min_seats=bulk_min_seats(cfg.bulk_min_fraction, self.max_num_seqs),
                                   loras=setup.loras)
        self.loras = setup.loras
        self.sampler = Sampler(spec.arch.vocab_size, self.device, self.eos_token_ids, self.backend)
        self.can_generate = self.causal and getattr(self.model, "can_generate", True)
        self.embeddings, self.embed_refusal = embeddings_for(self.model_path, spec.source.directory, spec.arch,
                                                             self.causal, self.max_model_len, self.tokenizer,
                                                             setup.num_blocks * cfg.block_size)
        pooler = pooling.Pooler(self.embeddings.pooling) if self.embeddings is not None else None
        self.runner = model_setup.make_runner(setup, cfg, self.device, self.max_model_len, self.sampler, self.guided,
                                              pooler, self.cascade)
        self.weight_bytes = [setup.weight_bytes]  # per rank
        if self.parallel is not None:
            self.weight_bytes = tp.gather_ints(setup.weight_bytes)
            self.runner.channel = self.parallel.channel
            self.parallel.start_serving()
            log.info("tensor_parallel_weights", bytes_per_rank=self.weight_bytes,
                     fused_decode="off: the one-call C++ decode step has no all-reduce between its layers")
        self.static_decode = setup.static_decode

    # ---- LoRA adapters (docs/adapters.md) -------------------------------------------------------------------

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT LoRA adapter in directory `path` as `name` (add_request(lora=name)). Raises LoraError
        naming the adapter and the field when it cannot be served; the engine serves on either way."""
        if self.loras is None:
            raise ValueError("this engine has no LoRA slots: start it with max_loras >= 1")
        self.loras.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Stop serving adapter `name`; refused (InvalidRequest) while requests inside the engine use it."""
        if self.loras is None:
            raise ValueError("this engine has no LoRA slots")
        self.loras.remove(name)

    def lora_names(self) -> list[str]:
        return self.loras.names() if self.loras is not None else []

    def _release_lora(self, seqs: list[Sequence]) -> None:
        if seqs and seqs[0].lora is not None:
            self.loras.request_done(seqs[0].lora)

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do for one rank)."""
        if self.parallel is not None:
            self.parallel.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests -------------------------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """A generation prompt's token ids (prompts.py), or InvalidRequest."""
        return prompts.tokenize(self.tokenizer, self.model.arch.vocab_size, prompt)

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams | EmbedParams | dict[str, Any] | None = None,
        priority: Priority | str | int = 0, lora: str | None = None,
    ) -> None:
        """Queue a request: a generation, or with EmbedParams an embedding of `prompt` (a string or token ids).
        priority: the job's Priority (or its name or rank, protocol.priority.rank_of); lower ranks are seated
        sooner, and requests of one priority in arrival order. lora: the name of an adapter add_lora registered
        (generation only), None for the base model."""
        if request_id in self.requests:
            raise EngineFault(f"request id {request_id!r} is already in the engine")  # the caller's bug
        if isinstance(params, EmbedParams):
            self._add_embedding(request_id, prompt, params, rank_of(priority))
            return
        if not self.can_generate:
            why = "it is an encoder" if not self.causal else "its checkpoint has no LM head (lm_head.weight)"
            raise refuse_kind(self.model_name, "generation", f"{why}; it serves embedding requests")
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        try:
            prompt_ids = self.tokenize(prompt)
        except EngineError:
            raise
        except Exception as err:  # the tokenizer's own failure (a chat template that raises) is the engine's
            raise fault(err, "tokenizing the prompt") from err
        self._check_stop_token_ids(params)
        total = len(prompt_ids) + params.max_tokens
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.max_model_len} tokens"
            )
        if total > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
                f"model context of {self.max_model_len} tokens; lower max_tokens or shorten the prompt"
            )
        if self.block_manager.blocks_for(total) > self.block_manager.num_blocks:
            raise InvalidRequest(
                f"prompt + max_tokens = {total} tokens can never fit the KV cache "
                f"({self.block_manager.num_blocks * self.config.block_size} tokens); raise kv_cache_gb"
            )
        rank = rank_of(priority)
        salt = None
        if lora is not None:
            if self.loras is None:
                raise InvalidRequest(f"LoRA adapter {lora!r} asked for, but this engine serves none (max_loras 0)",
                                     code="model_not_found")
            salt = self.loras.request_added(lora)  # its weights held in host memory until the request ends
        now = time.time()
        seqs = []
        for i in range(params.n):
            generator = None
            if params.seed is not None:  # choice i draws as a job seeded seed + i would
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed + i)
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            seqs.append(Sequence(request_id, prompt_ids, params, now, detokenizer, generator=generator,
                                 choice_index=i, priority=rank, lora=lora, cache_salt=salt))
        try:
            for seq in seqs:  # compiles response_format / regex / choice off this thread (GrammarError: failed before)
                self.guided.add(seq)
        except BaseException:
            self._release_lora(seqs)
            raise
        self.requests[request_id] = seqs[0]
        self.choices[request_id] = seqs
        self.scheduler.add(seqs[0])
        if len(seqs) > 1:
            if self.config.enable_prefix_caching:
                self.forks[request_id] = seqs[1:]
            else:
                for seq in seqs[1:]:
                    self.scheduler.add(seq)

    def _add_embedding(self, request_id: str, prompt: Prompt, params: EmbedParams, priority: int) -> None:
        if self.embeddings is None:
            raise refuse_kind(self.model_name, "embedding", self.embed_refusal)
        try:
            seq = self.embeddings.sequence(request_id, prompt, params, priority)
        except EngineError:
            raise
        except Exception as err:  # the tokenizer's own failure is the engine's
            raise fault(err, "tokenizing the input") from err
        self.requests[request_id] = seq
        self.choices[request_id] = [seq]
        self.scheduler.add(seq)

    def _check_stop_token_ids(self, params: SamplingParams) -> None:
        # An id past the vocabulary would fail the sampler's min_tokens ban (an IndexError mid-step).
        vocab = self.model.arch.vocab_size
        bad = [t for t in params.stop_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"stop_token_ids out of the vocabulary [0, {vocab}): {bad[:5]}")

    def abort(self, request_id: str) -> RequestOutput | None:
        seqs = self.choices.pop(request_id, None)
        if seqs is None:
            return None
        del self.requests[request_id]
        self.forks.pop(request_id, None)
        self._release_lora(seqs)
        for seq in seqs:
            if seq.finish_reason is None:
                self.scheduler.remove(seq)  # frees only its own references: a block another holds stays
                seq.finish_reason = "abort"
        return self._output(seqs)

    # ---- stepping -------------------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        in_flight = self.overlap is not None and self.overlap.busy()
        return self.scheduler.has_unfinished() or bool(self.forks) or in_flight

    def step(self) -> list[RequestOutput]:
        """One forward pass. Returns the requests that ended in it; `deltas` holds what every request that
        sampled a token gained (streaming, time to first token)."""
        self.deltas = StepDeltas()
        self.rejected = {}
        for seq, err in self.guided.take_failed():  # a grammar the engine could not compile: that request only
            seqs = self.choices.pop(seq.request_id, None)
            if seqs is None:  # another choice of the same request already took it out
                continue
            del self.requests[seq.request_id]
            self.forks.pop(seq.request_id, None)
            for choice in seqs:
                self.scheduler.remove(choice)
            self._release_lora(seqs)
            self.rejected[seq.request_id] = err
        if self.overlap is not None:
            return self.overlap.step()
        batch = self.scheduler.schedule()
        if batch is None or not batch.seqs:
            self.guided.wait(0.01)  # nothing runnable but grammars compiling: do not spin
            return []
        sampled, tokens, logprob_rows = self.runner.run(batch)
        return self.finish_step(batch, sampled, tokens, logprob_rows)

    def finish_step(self, batch: ScheduledBatch, sampled: list[Sequence], tokens: list[int],
                    logprob_rows: list | None) -> list[RequestOutput]:
        """After a step's forward pass: postprocess, deltas, forks, and the requests that ended."""
        finished = self.scheduler.postprocess(batch, sampled, tokens, logprob_rows, time.time())
        self.deltas = StepDeltas(sampled, tokens)  # a stream carries choice 0
        self.generated_tokens += len(tokens)
        self.steps += 1
        self._release_forks()
        outputs = []
        for seq in finished:
            seqs = self.choices.get(seq.request_id)
            if seqs is not None and all(s.finish_reason is not None for s in seqs):
                del self.choices[seq.request_id], self.requests[seq.request_id]
                self._release_lora(seqs)
                outputs.append(self._output(seqs))
        return outputs

    def _release_forks(self) -> None:
        for request_id, seqs in list(self.forks.items()):
            head = self.requests[request_id]
            if head.num_output_tokens > 0 or head.finish_reason is not None:
                del self.forks[request_id]
                for seq in reversed(seqs):  # ahead of newer requests of their priority: the prompt is cached now
                    self.scheduler.add(seq, first_of_its_priority=True)

    def _output(self, seqs: list[Sequence]) -> RequestOutput:
        seq = seqs[0]
        embedding = None
        if seq.pool_state is not None and seq.finish_reason == "stop":
            embedding = pooling.output_vector(self.embeddings.pooling, seq.pool_state)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=seq.output_text,
            finish_reason=seq.finish_reason or "abort",
            logprobs=seq.logprobs,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            finish_time=time.time(),
            num_preemptions=seq.num_preemptions,
            num_cached_tokens=seq.num_cached_tokens,
            choices=[Choice(s.choice_index, s.output_token_ids, s.output_text, s.finish_reason or "abort",
                            s.logprobs) for s in seqs],
            embedding=embedding,
        )

    def stats(self) -> EngineStats:
        bm = self.block_manager
        pc, cs = bm.stats, self.cascade.stats
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting), free_blocks=bm.num_free,
            used_blocks=bm.num_used, total_blocks=bm.num_blocks, preemptions=self.scheduler.num_preemptions,
            generated_tokens=self.generated_tokens, steps=self.steps, cached_blocks=bm.num_cached,
            prefix_queried_tokens=pc.queried_tokens, prefix_hit_tokens=pc.hit_tokens,
            prefix_queried_blocks=pc.queried_blocks, prefix_hit_blocks=pc.hit_blocks,
            prefix_evictions=pc.evictions, forking=sum(len(f) for f in self.forks.values()),
            cascade_steps=cs.steps, cascade_groups=cs.groups, cascade_grouped_rows=cs.grouped_rows,
            decode_kv_tokens_read=cs.kv_tokens_read, decode_kv_tokens_plain=cs.kv_tokens_plain,
            **(self.loras.stats() if self.loras is not None else {}),
        )

    def generate(
        self,
        prompts: Seq[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        loras: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Offline: run every prompt to the end and return the outputs in input order. InvalidRequest (with the
        code), once every other request ended, when the engine refused a prompt's grammar (structured output);
        EngineFault when compiling one broke. loras: each prompt's adapter name (None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt given bare
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        return offline.run(self, "generate", prompts, params_list, loras)

    def embed(self, inputs: Seq[str | list[int]] | str,
              params: EmbedParams | list[EmbedParams] | None = None) -> list[RequestOutput]:
        """Offline: embed every input (strings or token-id lists) and return the outputs, each with its
        `embedding`, in input order."""
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]  # one input given bare
        params_list = params if isinstance(params, list) else [params or EmbedParams()] * len(inputs)
        return offline.run(self, "embed", inputs, params_list)

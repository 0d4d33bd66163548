"""The engine: requests in, one forward pass per step over every running sequence, results out as each ends.

    add_request ──▶ Scheduler.schedule ──▶ ModelRunner.run (model + backend kernels, Sampler)
                         ▲                                │
                         └──── Scheduler.postprocess ◀────┘  tokens, text, stops; finished ones leave
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence as Seq
from typing import Any

import structlog
import torch

from protocol.priority import Priority, rank_of
from worker.engine import kv_cache, loader, warmup
from worker.engine.backends import select_backend
from worker.engine.block_manager import BlockManager
from worker.engine.cascade import CascadePlanner
from worker.engine.config import EngineConfig, bulk_min_seats
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.errors import EngineError, EngineFault, InvalidRequest, fault
from worker.engine.guided import GuidedDecoding
from worker.engine.model_runner import ModelRunner, kv_bytes_per_block
from worker.engine.models import registry
from worker.engine.outputs import Choice, EngineStats, RequestOutput, StepDeltas
from worker.engine.overlap import Overlap
from worker.engine.quant import fp8, schemes
from worker.engine.sampler import Sampler
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import ScheduledBatch, Scheduler
from worker.engine.sequence import Sequence
from worker.engine.stop_checker import StopChecker

log = structlog.get_logger("tokenbus.engine")

Prompt = str | list[int] | list[dict[str, Any]]
CUDA_MAX_NUM_SEQS = 256  # max_num_seqs when the config leaves it None: a GPU step is cheap per row
CPU_MAX_NUM_SEQS = 64  # the CPU's panel linears serve up to 64 rows (backends/cpu_linear.py)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
        self.device = torch.device(_resolve_device(cfg.device))
        self.dtype = DTYPES[cfg.dtype] if cfg.dtype != "auto" else (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        started = time.perf_counter()
        source = loader.resolve(cfg.model, cfg.cache_dir)
        hf_config = loader.load_config(source)
        arch = registry.model_arch(hf_config, cfg.model, cfg.model_impl)
        self.model_path = registry.model_path(arch)  # "native" or "transformers"
        self.model_name = cfg.model
        self.tokenizer = loader.load_tokenizer(source)
        self.eos_token_ids = loader.load_generation_eos(source, hf_config, self.tokenizer)
        self.max_model_len = min(cfg.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
        schemes.check_scheme(cfg.quantization, self.device, self.dtype)
        fp8_loading = fp8.plan(hf_config, source.directory, cfg, self.device, self.model_path)
        self.backend = select_backend(self.device, self.dtype, cfg.cpu_kernels, cfg.cache_dir)
        self.backend.check_model(arch, cfg.model)
        self.kv_dtype = kv_cache.storage_dtype(cfg.kv_cache_dtype, self.device, self.dtype, self.backend.name)
        self.max_num_seqs = cfg.max_num_seqs or (CUDA_MAX_NUM_SEQS if self.device.type == "cuda" else CPU_MAX_NUM_SEQS)
        if cfg.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) on {self.device.type}: each running sequence needs one token of the budget"
            )
        # graphs replay the padded decode path, so they need it; static_decode None follows the graphs
        self.cuda_graphs = self.device.type == "cuda" and cfg.cuda_graphs and cfg.static_decode is not False
        # transformers' own modeling code was never checked under graph capture: the fallback runs eagerly
        self.cuda_graphs = self.cuda_graphs and self.model_path == "native"
        static_decode = cfg.static_decode if cfg.static_decode is not None else self.cuda_graphs
        self.model = registry.build_model(arch, hf_config, source, self.backend, self.dtype, self.device,
                                          self.max_model_len, fp8_loading.weights(loader.iter_weights),
                                          prepare=fp8_loading.prepare)
        fp8_loading.finish(self.model, self.device)
        self.quantized_cache = None  # the int8 cache file this engine read or wrote
        if cfg.quantization in ("int8", "w8a8"):
            self.quantized_cache = schemes.apply_int8(self.model, source.directory, cfg.cache_dir,
                                                           w8a8=cfg.quantization == "w8a8")
            self.model.eval().requires_grad_(False)
        self.backend.prepare(self.model)
        max_blocks_per_seq = -(-self.max_model_len // cfg.block_size)
        self.backend.reserve(arch, self.max_num_seqs, max_blocks_per_seq * cfg.block_size, self.device)
        num_blocks = self._num_kv_blocks()
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.cascade = CascadePlanner(self.block_manager, cfg.cascade_attention)
        self.stop_checker = StopChecker(self.eos_token_ids)
        self.guided = GuidedDecoding(self.tokenizer, arch.vocab_size, self.eos_token_ids, self.device)
        self.scheduler = Scheduler(self.block_manager, self.stop_checker, self.max_num_seqs,
                                   cfg.max_num_batched_tokens, self.guided,
                                   bulk_min_seats=bulk_min_seats(cfg.bulk_min_fraction, self.max_num_seqs))
        self.sampler = Sampler(arch.vocab_size, self.device, self.eos_token_ids, self.backend)
        self.runner = ModelRunner(self.model, self.sampler, num_blocks, cfg.block_size, self.device, self.kv_dtype,
                                  self.max_num_seqs, self.max_model_len, static_decode, guided=self.guided,
                                  cascade=self.cascade)
        if self.device.type == "cuda":
            self._warm_up()
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
            "engine_ready", model=cfg.model, device=str(self.device), dtype=str(self.dtype), kv_blocks=num_blocks,
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            block_size=cfg.block_size, max_model_len=self.max_model_len, backend=self.backend.name,
            max_num_seqs=self.max_num_seqs, static_decode=static_decode, cuda_graphs=self.cuda_graphs,
            model_path=self.model_path, overlap=overlap, load_s=round(time.perf_counter() - started, 2),
        )

    def _num_kv_blocks(self) -> int:
        """Blocks for the sequences (the runner adds one pad block): a fixed count, kv_cache_gb, or on CUDA
        what the card has left after the profiled peak of the largest step and the graphs' pool."""
        cfg = self.config
        per_block = kv_bytes_per_block(self.model, cfg.block_size, self.kv_dtype)
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        if cfg.kv_cache_gb is not None:
            budget = cfg.kv_cache_gb * 1024**3
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = 1024**3
        blocks = int(budget // per_block) - 1
        if blocks < 1:
            raise ValueError("no memory left for the KV cache: raise kv_cache_gb / gpu_memory_utilization")
        return blocks

    def _cuda_kv_budget(self) -> float:
        cfg = self.config
        width = -(-self.max_model_len // cfg.block_size)
        args = (cfg.block_size, self.kv_dtype, self.device)
        peak = warmup.profile_peak(self.model, cfg.max_num_batched_tokens, self.max_num_seqs, self.max_model_len,
                                   *args)
        graphs = warmup.decode_peak(self.model, self.max_num_seqs, width, *args) if self.cuda_graphs else 0
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * cfg.gpu_memory_utilization - peak - graphs
        # another process on the card shrinks what is really free
        budget = min(budget, free - graphs - (peak - torch.cuda.memory_allocated(self.device)))
        log.info("kv_cache_plan", total_gib=round(total / 1024**3, 2), peak_gib=round(peak / 1024**3, 3),
                 graph_pool_gib=round(graphs / 1024**3, 3), kv_gib=round(max(budget, 0) / 1024**3, 2))
        return max(budget, 0)

    def _warm_up(self) -> None:
        """Every kernel variant the serve loop hits, compiled before the first request; then the graphs."""
        started = time.perf_counter()
        runner, cfg = self.runner, self.config
        shapes = runner.static.shapes() if runner.static is not None and not self.cuda_graphs else None
        warmup.warm_up(self.model, runner.kv_caches, runner.pad_block, cfg.block_size, runner.max_blocks_per_seq,
                       self.max_num_seqs, cfg.max_num_batched_tokens, shapes)
        torch.cuda.synchronize(self.device)
        warm_s = time.perf_counter() - started
        graph_s = runner.static.capture() if self.cuda_graphs else 0.0
        log.info("engine_warmed_up", kernels_s=round(warm_s, 2), graphs_s=round(graph_s, 2))

    # ---- requests -------------------------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            for m in prompt:
                if "role" not in m or "content" not in m:
                    raise InvalidRequest(f"each chat message needs 'role' and 'content', got {m!r}")
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        if isinstance(prompt, list | tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise InvalidRequest("the prompt is empty")
            vocab = self.model.arch.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise InvalidRequest(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
            return list(prompt)
        raise InvalidRequest("a prompt is a non-empty string, a list of token ids, or a list of chat messages")

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams | dict[str, Any] | None = None,
        priority: Priority | str | int = 0,
    ) -> None:
        """Queue a request. priority: the job's Priority (or its name or rank, protocol.priority.rank_of); lower
        ranks are seated sooner, and requests of one priority in arrival order."""
        if request_id in self.requests:
            raise EngineFault(f"request id {request_id!r} is already in the engine")  # the caller's bug
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
        now = time.time()
        seqs = []
        for i in range(params.n):
            generator = None
            if params.seed is not None:  # choice i draws as a job seeded seed + i would
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed + i)
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            seqs.append(Sequence(request_id, prompt_ids, params, now, detokenizer, generator=generator,
                                 choice_index=i, priority=rank))
        for seq in seqs:  # compiles response_format / regex / choice off this thread (GrammarError: failed before)
            self.guided.add(seq)
        self.requests[request_id] = seqs[0]
        self.choices[request_id] = seqs
        self.scheduler.add(seqs[0])
        if len(seqs) > 1:
            if self.config.enable_prefix_caching:
                self.forks[request_id] = seqs[1:]
            else:
                for seq in seqs[1:]:
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
        )

    def generate(
        self,
        prompts: Seq[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Offline: run every prompt to the end and return the outputs in input order. InvalidRequest (with the
        code), once every other request ended, when the engine refused a prompt's grammar (structured output);
        EngineFault when compiling one broke."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt given bare
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"generate-{self.steps}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(rid, prompt, p)
        results: dict[str, RequestOutput] = {}
        rejected: dict[str, EngineError] = {}
        while len(results) + len(rejected) < len(ids):
            for out in self.step():
                results[out.request_id] = out
            rejected.update(self.rejected)
        if rejected:
            why = "; ".join(f"prompt {ids.index(rid)}: {err}" for rid, err in rejected.items())
            errors = list(rejected.values())
            if all(isinstance(err, InvalidRequest) for err in errors):
                raise InvalidRequest(why, code=errors[0].code)
            raise EngineFault(why)
        return [results[rid] for rid in ids]


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available here")
    return device

"""The engine loop: add requests, then step (schedule -> forward -> sample -> finish) until done."""

from __future__ import annotations

import random

import torch

from pagedinfer.attention.kv_cache import KVCache, bytes_per_token
from pagedinfer.config import EngineConfig
from pagedinfer.core.beam import BeamSearch, Candidate
from pagedinfer.core.block_pool import BlockPool
from pagedinfer.core.scheduler import Scheduler, SchedulerOutput
from pagedinfer.core.sequence import Request, Sequence
from pagedinfer.engine.detokenizer import IncrementalDetokenizer
from pagedinfer.engine.stats import EngineStats
from pagedinfer.model.loader import LoadedModel
from pagedinfer.model.runner import ModelRunner
from pagedinfer.model.sampler import beam_candidates, sample
from pagedinfer.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from pagedinfer.sampling_params import BeamSearchParams, SamplingParams


class LLMEngine:
    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, use_cuda_kernels: bool | None = None
    ) -> None:
        self.loaded = loaded
        self.config = config
        self.max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        per_block = bytes_per_token(loaded.layer_shapes, loaded.dtype) * config.block_size
        num_blocks, self.pool_source = config.pool_blocks(per_block, loaded.device, self.max_model_len)
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv = KVCache(loaded.layer_shapes, num_blocks, config.block_size, loaded.dtype, loaded.device)
        self.scheduler = Scheduler(
            self.pool, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len
        )
        self.runner = ModelRunner(loaded.model, self.kv, loaded.device, self._backend(use_cuda_kernels))
        self._seeds = random.Random(config.seed)
        self._next_id = 0
        self.trace: list[dict] | None = None  # per-step pool snapshots, when enabled
        self.reset_stats()

    def _backend(self, requested: bool | None) -> bool:
        """CUDA kernels when asked (or, by default, on a CUDA device with CuPy); else the torch path."""
        if requested is False or (requested is None and self.loaded.device.type != "cuda"):
            return False
        from pagedinfer.attention import cuda_kernels

        dims = {(s.head_dim, s.head_dim_v) for s in self.loaded.layer_shapes.values()}
        reason = cuda_kernels.unsupported_reason(dims, self.loaded.dtype, self.config.block_size)
        if requested is None:
            return reason is None and cuda_kernels.is_available()
        if reason:
            raise ValueError(f"use_cuda_kernels=True but {reason}")
        return True

    def reset_stats(self) -> None:
        self.stats = EngineStats(
            num_blocks=self.pool.num_blocks,
            block_size=self.pool.block_size,
            bytes_per_token=self.kv.bytes_per_token,
            bytes_per_block=self.kv.bytes_per_block,
            pool_source=self.pool_source,
            max_model_len=self.max_model_len,
            prefix_caching=self.pool.enable_prefix_caching,
        )
        pool, sched = self.pool, self.scheduler
        self._bases = (
            pool.num_cow_copies,
            sched.num_preemptions,
            pool.prefix_queries,
            pool.prefix_hits,
            pool.blocks_reused,
            pool.evictions,
            sched.num_prompt_tokens_readmitted,
        )

    def enable_trace(self) -> None:
        self.trace = []
        self.pool.events = []

    # -- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """A prompt string, or ``{"prompt_token_ids": [...]}`` -> (text, token ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                vocab = self.loaded.model.get_input_embeddings().num_embeddings
                if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                    raise ValueError(f"prompt_token_ids must be a list of integers in [0, {vocab})")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string or a dict, not {type(prompt).__name__}")
        if self.loaded.tokenizer is None:
            raise ValueError(f"model {self.loaded.name} has no tokenizer: give prompts as prompt_token_ids")
        return prompt, self.loaded.tokenizer(prompt)["input_ids"]

    def add_request(
        self,
        prompt: str | dict,
        params: SamplingParams | BeamSearchParams,
        request_id: str | None = None,
        order: int | None = None,
    ) -> Request:
        """Queue a request; one that can never run comes back already finished with ``error`` set.

        With `BeamSearchParams` the request runs ``beam_width`` beams (greedy, no stop strings).
        """
        text, ids = self.tokenize(prompt)
        order = self._next_id if order is None else order
        self._next_id += 1
        beam = None
        if isinstance(params, BeamSearchParams):
            beam, params = (
                params,
                SamplingParams(
                    n=params.beam_width,
                    temperature=0,
                    max_tokens=params.max_tokens,
                    ignore_eos=params.ignore_eos,
                    stop_token_ids=params.stop_token_ids,
                ),
            )
        req = Request(
            request_id=str(order if request_id is None else request_id),
            order=order,
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            max_tokens=self._max_tokens(ids, params),
            base_seed=params.seed if params.seed is not None else self._seeds.getrandbits(62),
        )
        req.error = self.request_error(ids, params)
        if beam is not None:
            stops = set(params.stop_token_ids) | (set() if beam.ignore_eos else self.loaded.eos_token_ids)
            req.beam = BeamSearch(
                beam.beam_width, req.max_tokens, beam.length_penalty, beam.early_stopping, frozenset(stops)
            )
        self.stats.requests += 1
        if req.error:
            self.stats.failed_requests += 1
        else:
            self.stats.prompt_tokens += req.num_prompt_tokens
            self.stats.prompt_tokens_requested += req.num_prompt_tokens * params.n
            self.stats.samples += params.n
            self.scheduler.add(req)
        return req

    def _max_tokens(self, token_ids: list[int], params: SamplingParams) -> int:
        return min(params.max_tokens or self.max_model_len, self.max_model_len - len(token_ids))

    def request_error(self, token_ids: list[int], params: SamplingParams) -> str | None:
        """Why a prompt of these tokens can never run on this model and pool (None if it can)."""
        return self.scheduler.check(len(token_ids), params.n, self._max_tokens(token_ids, params))

    def abort_all(self) -> None:
        """Drop every unfinished request and return its blocks to the pool."""
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            self.scheduler.finish_request(req)
        self.scheduler.waiting.clear()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one batch; return the requests that finished in it."""
        plan = self.scheduler.schedule()
        self._record(plan)
        finished: list[Request] = []
        if plan.seqs:
            logits = self.runner.execute(plan.seqs, plan.copies)  # [R, V]
            rows, seqs = self._advance(plan)
            beams = [i for i, s in enumerate(seqs) if s.request.beam is not None]
            if beams:
                rows, seqs = self._park_beams(logits, rows, seqs, beams, finished)
            if seqs:
                if rows != list(range(logits.shape[0])):  # forked samples share their prompt's row
                    logits = logits[torch.tensor(rows, device=logits.device)]  # [len(seqs), V]
                self._append(sample(logits, seqs, self.loaded.eos_token_ids), seqs, finished)
        if self.trace is not None:
            self._snapshot(plan)
        return finished

    def _advance(self, plan: SchedulerOutput) -> tuple[list[int], list[Sequence]]:
        """Mark this step's tokens computed; fork finished prompts. Returns logit row per sampling seq."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        row = 0
        for s in plan.seqs:
            seq, req = s.seq, s.seq.request
            seq.num_computed += s.num_tokens
            self.scheduler.register(seq)
            if seq.index < 0:
                self.stats.prompt_tokens_computed += s.num_tokens
                if seq.num_pending == 0:
                    fresh = not req.samples
                    if fresh:  # a beam search starts from one beam
                        n = 1 if req.beam is not None else req.params.n
                        req.samples = [self._new_sample(req, i) for i in range(n)]
                    self.scheduler.fork(req)
                    if fresh:
                        rows += [row] * len(req.samples)
                        seqs += req.samples
            else:
                self.stats.output_tokens_recomputed += s.num_tokens - (1 if s.sample else 0)
                if s.sample:
                    rows.append(row)
                    seqs.append(seq)
            row += s.sample
        return rows, seqs

    def _park_beams(
        self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence], beams: list[int], finished: list
    ) -> tuple[list[int], list[Sequence]]:
        """Park each beam's logits row; step every beam search whose live beams all have theirs.

        Returns the rows and sequences left for the sampler.
        """
        ready = {}
        for i in beams:
            seq = seqs[i]
            seq.beam_logits = logits[rows[i]]  # [V]
            ready[id(seq.request)] = seq.request
        for req in ready.values():
            if all(b.beam_logits is not None for b in req.samples):
                self._beam_step(req, finished)
        keep = [i for i, s in enumerate(seqs) if s.request.beam is None]
        return [rows[i] for i in keep], [seqs[i] for i in keep]

    def _beam_step(self, req: Request, finished: list[Request]) -> None:
        state, beams = req.beam, req.samples
        stacked = torch.stack([b.beam_logits for b in beams])  # [B, V]
        found = beam_candidates(stacked, [b.cumulative_logprob for b in beams], state.num_candidates)
        running = state.step([Candidate(*c) for c in found], [b.output_ids for b in beams])
        self.stats.generated_tokens += len(beams)
        if state.done:
            self.scheduler.finish_request(req)
            finished.append(req)
        else:
            self.scheduler.advance_beams(req, running)

    def output(self, req: Request) -> RequestOutput | BeamSearchOutput:
        """What the caller gets for a finished (or failed) request."""
        if req.beam is None:
            return req.to_output()
        tok = self.loaded.tokenizer
        return BeamSearchOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            sequences=[
                BeamSearchSequence(
                    token_ids=h.token_ids,
                    text=tok.decode(h.token_ids, skip_special_tokens=True) if tok is not None else "",
                    cumulative_logprob=h.cumulative_logprob,
                    score=h.score,
                    finish_reason=h.finish_reason,
                )
                for h in req.beam.finished
            ],
            error=req.error,
        )

    def _new_sample(self, req: Request, index: int) -> Sequence:
        p = req.params
        tok = self.loaded.tokenizer
        detok = None
        if tok is not None:
            detok = IncrementalDetokenizer(
                tok.backend_tokenizer,
                req.prompt_token_ids,
                p.skip_special_tokens,
                p.stop,
                p.include_stop_str_in_output,
            )
        return Sequence(
            request=req,
            index=index,
            token_ids=list(req.prompt_token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            generator=req.sample_generator(index),
            detok=detok,
            logprobs=[] if p.logprobs is not None else None,
        )

    def _append(self, result, seqs: list[Sequence], finished: list[Request]) -> None:
        eos = self.loaded.eos_token_ids
        for seq, token, logprob, top in zip(seqs, result.token_ids, result.logprobs, result.top, strict=True):
            req, p = seq.request, seq.request.params
            seq.token_ids.append(token)
            if seq.logprobs is not None:
                seq.cumulative_logprob += logprob
                seq.logprobs.append(top)
            self.stats.generated_tokens += 1
            if token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            elif token in eos and not p.ignore_eos:
                seq.finish_reason = "stop"
            elif seq.detok is not None and (stop := seq.detok.step(token)) is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop
            elif seq.num_output_tokens >= req.max_tokens:
                seq.finish_reason = "length"
            if seq.finished:
                self.scheduler.finish_seq(seq)
                if req.finished:
                    self.scheduler.finish_request(req)
                    finished.append(req)

    # -- statistics -------------------------------------------------------------------------
    def _record(self, plan: SchedulerOutput) -> None:
        running = self.scheduler.running
        self.stats.record_step(
            blocks_used=self.pool.num_used,
            slots_filled=self.pool.num_filled_slots,
            logical=sum(len(s.block_table) for r in running for s in r.live_seqs()),
            seqs=sum(r.num_future_seqs() for r in running),
            tokens=plan.num_tokens,
            cached=self.pool.num_cached,
        )
        self._count_totals()

    def _count_totals(self) -> None:
        """This run's share of the pool's and scheduler's running counters."""
        pool, sched, st = self.pool, self.scheduler, self.stats
        now = (
            pool.num_cow_copies,
            sched.num_preemptions,
            pool.prefix_queries,
            pool.prefix_hits,
            pool.blocks_reused,
            pool.evictions,
            sched.num_prompt_tokens_readmitted,
        )
        (
            st.cow_copies,
            st.preemptions,
            st.prefix_cache_queries,
            st.prefix_cache_hits,
            st.prefix_cache_blocks_reused,
            st.prefix_cache_evictions,
            st.prompt_tokens_readmitted,
        ) = (a - b for a, b in zip(now, self._bases, strict=True))

    def _snapshot(self, plan: SchedulerOutput) -> None:
        """One step of the trace: scheduled work, pool events, every block's count, every table."""
        tables = {s.name: list(s.block_table) for r in self.scheduler.running for s in r.live_seqs()}
        self.trace.append(
            {
                "step": len(self.trace),
                "scheduled": [
                    {"seq": s.seq.name, "start": s.start, "tokens": s.num_tokens} for s in plan.seqs
                ],
                "copies": [list(c) for c in plan.copies],
                "preempted": [r.request_id for r in plan.preempted],
                "events": [e.__dict__ for e in self.pool.events],
                "ref_counts": {b: c for b, c in enumerate(self.pool.ref_counts) if c},
                "filled": {b: f for b, f in enumerate(self.pool.filled) if self.pool.ref_counts[b]},
                "tables": tables,
            }
        )
        self.pool.events.clear()

"""The engine loop: add requests, then step (schedule -> execute -> sample -> update) until done."""

from __future__ import annotations

import functools
import random
import warnings
from dataclasses import dataclass
from time import monotonic

import torch

from pagedinfer.attention.interface import select_cuda_kernels
from pagedinfer.attention.kv_cache import KVCache, bytes_per_token
from pagedinfer.config import EngineConfig
from pagedinfer.core.beam import BeamSearch, Candidate
from pagedinfer.core.block_pool import BlockPool
from pagedinfer.core.scheduler import PromptRows, SampleTarget, Scheduler, SchedulerCounters, SchedulerOutput
from pagedinfer.core.sequence import Request, RequestState
from pagedinfer.core.trace import snapshot
from pagedinfer.engine import fingerprint
from pagedinfer.engine.detokenizer import IncrementalDetokenizer
from pagedinfer.engine.intake import EngineRequest, Rejected
from pagedinfer.engine.stats import EngineStats
from pagedinfer.logits.controls import AllowedTokens, BadWords, LogitBias, MinTokens, Penalties
from pagedinfer.logits.processor import LogitsPipeline, LogitsState
from pagedinfer.logits.structured import GrammarCompiler, GrammarProcessor
from pagedinfer.lora.adapter import AdapterError
from pagedinfer.lora.registry import AdapterRegistry, LoadedAdapter
from pagedinfer.lora.request import LoRARequest
from pagedinfer.model.cuda_graphs import GRAPH_MAX_CONTEXT, DecodeGraphs
from pagedinfer.model.dtype import dtype_name
from pagedinfer.model.loader import LoadedModel
from pagedinfer.model.lora_sites import attach_sites
from pagedinfer.model.runner import ModelRunner
from pagedinfer.model.sampler import (
    NonFinite,
    SampleResult,
    SampleRow,
    beam_candidates,
    found_words,
    logprob_entries,
    sample,
)
from pagedinfer.outputs import BeamSearchOutput, BeamSearchSequence, Logprob, RequestOutput
from pagedinfer.sampling_params import BeamSearchParams, SamplingParams
from pagedinfer.seeding import completion_seed

PROMPT_LOGPROB_SLICE = 128  # prompt logits rows normalised at once


@dataclass
class StartedRequest:
    """An unfinished request that has started: its id, the tokens its completions hold, for how long."""

    request_id: str
    tokens: int
    running_s: float


class MaxModelLenCapped(UserWarning):
    """``max_model_len`` above the model's context: the engine runs with the model's (vLLM refuses;
    a batch job is better served capped, and told)."""


def capped_context_words(name: str, requested: int | None, context: int) -> str | None:
    """What to say when ``requested`` (the setting ``name``) exceeds the model's ``context``; None when
    it does not. One wording for the API's warning and the command line's note."""
    if requested is None or requested <= context:
        return None
    return f"{name} {requested} is above the model's context ({context} tokens): using {context}"


def _no_token_reason(params: SamplingParams) -> str:
    given = [
        name
        for name in ("allowed_token_ids", "bad_words", "min_tokens", "structured_outputs")
        if getattr(params, name)
    ]
    return f"no token can be generated here: {', '.join(given)} exclude every token of the vocabulary"


def _nonfinite_reason(found: str, where: str, controls: str | None, adapter: str | None) -> str:
    """A request's error for a logits row with NaN or infinite values (``where``: "generated token 3"),
    naming what made them: the weights (or the adapter the request runs with), or its logit controls."""
    if controls is not None:
        return (
            f"the logits became non-finite ({found}) at {where} under {controls}; the model's own logits "
            "were finite"
        )
    holder = "the model's weights" if adapter is None else f"the model's weights or the adapter {adapter!r}"
    return (
        f"the model produced non-finite logits ({found}) at {where}: {holder} hold NaN or Inf values, "
        "or overflow float32"
    )


def graph_plan(
    device: torch.device, use_cuda_kernels: bool, enforce_eager: bool, buffers_on_cpu: bool
) -> tuple[bool, str]:
    """Whether decode steps go through the CUDA graph path, and the report's words for the choice."""
    if device.type != "cuda":
        if buffers_on_cpu:
            return True, "static buffers on the CPU (tests): no capture"
        return False, "not applicable on the CPU"
    if enforce_eager:
        return False, "off: enforce_eager"
    if not use_cuda_kernels:
        return False, "off: the torch attention path reads host values (graphs need the CuPy kernels)"
    return True, "on"


class LLMEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        use_cuda_kernels: bool | None = None,
        graph_buffers_on_cpu: bool = False,
    ) -> None:
        """``graph_buffers_on_cpu`` (tests): on the CPU, decode steps go through the CUDA graph path's
        static buffers and padding, run eagerly (nothing to capture)."""
        self.loaded = loaded
        self.config = config
        self.max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        if words := capped_context_words("max_model_len", config.max_model_len, loaded.max_model_len):
            warnings.warn(words, MaxModelLenCapped, stacklevel=3)  # at the caller of LLM(...)
        self.vocab_size: int = loaded.model.get_input_embeddings().num_embeddings
        kv_dtype = config.kv_dtype(loaded.dtype)  # [the pool's dtype]
        per_block = bytes_per_token(loaded.layer_shapes, kv_dtype) * config.block_size
        self.pool_size = config.pool_size(per_block, loaded.device, self.max_model_len)
        num_blocks = self.pool_size.num_blocks
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        kernels = select_cuda_kernels(
            use_cuda_kernels, loaded.device, loaded.layer_shapes, loaded.dtype, config.block_size, kv_dtype
        )
        graphs, self.graph_mode = graph_plan(
            loaded.device, kernels, config.enforce_eager, graph_buffers_on_cpu
        )
        # with graphs the tensors hold one block more than the pool: the padding rows' scratch block
        self.kv = KVCache(
            loaded.layer_shapes, num_blocks + int(graphs), config.block_size, kv_dtype, loaded.device
        )
        self.lora: AdapterRegistry | None = None  # the adapters, when LoRA is enabled
        if config.enable_lora:
            sites = attach_sites(loaded.model, loaded.impl, loaded.device)
            self.lora = AdapterRegistry(sites, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        self.scheduler = Scheduler(
            self.pool,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            loaded.eos_token_ids,
            config.schedule_policy,
            context_set_by_option=self.max_model_len < loaded.max_model_len,
            adapters=self.lora,
        )
        self.runner = ModelRunner(loaded.model, self.kv, loaded.device, kernels)
        vocab, tok, eos = self.vocab_size, loaded.tokenizer, loaded.eos_token_ids
        self.grammars = GrammarCompiler(tok, vocab, eos)
        self.logits = LogitsPipeline(  # vLLM's order
            [
                AllowedTokens(vocab),
                BadWords(tok, vocab),
                MinTokens(eos, vocab),
                LogitBias(vocab),
                Penalties(),
                GrammarProcessor(self.grammars),
            ]
        )
        if graphs:
            self._start_graphs(num_blocks)
        self._seeds = random.Random(config.seed)
        self._next_id = 0
        self.trace: list[dict] | None = None  # per-step pool snapshots, when enabled
        self._fingerprints: dict[str | None, str] = {}  # by adapter name (None: the base model)
        self.reset_stats()

    def _start_graphs(self, scratch_block: int) -> None:
        """Decode steps through static buffers; on CUDA their graphs captured now (the time is reported).
        A failed capture leaves every step eager and says why."""
        graphs = DecodeGraphs(
            self.loaded.model,
            self.kv,
            self.loaded.device,
            self.runner.use_cuda_kernels,
            self.config.max_num_seqs,
            min(self.max_model_len, GRAPH_MAX_CONTEXT),
            scratch_block,
        )
        self.runner.graphs = graphs
        if self.loaded.device.type != "cuda":
            return
        try:
            graphs.capture()
        except Exception as e:  # noqa: BLE001 - eager steps still serve every request
            self.runner.graphs = None
            self.graph_mode = f"off: capture failed: {type(e).__name__}: {str(e).strip().splitlines()[0]}"
            warnings.warn(f"CUDA graphs {self.graph_mode}", stacklevel=2)
            return
        b = graphs.buckets
        self.graph_mode = (
            f"on: batch sizes {', '.join(map(str, b))} captured in {graphs.capture_s:.2f} s, "
            f"contexts up to {graphs.max_context} tokens"
        )

    def reset_stats(self) -> None:
        self.stats = EngineStats(
            num_blocks=self.pool.num_blocks,
            block_size=self.pool.block_size,
            bytes_per_token=self.kv.bytes_per_token,
            bytes_per_block=self.kv.bytes_per_block,
            pool_size=self.pool_size,
            max_model_len=self.max_model_len,
            prefix_caching=self.pool.enable_prefix_caching,
            schedule_policy=self.scheduler.schedule_policy,
            counters=SchedulerCounters(),
            dtype=dtype_name(self.loaded.dtype),
            dtype_reason=self.loaded.dtype_reason,
            dtype_emulated=self.loaded.dtype_emulated,
            kv_cache_dtype=dtype_name(self.kv.dtype),
            weight_bytes=self.loaded.weights.bytes,
            linear_bits_per_weight=self.loaded.weights.linear_bits_per_weight,
            cuda_graphs=self.graph_mode,
            graph_capture_s=self.runner.graphs.capture_s if self.runner.graphs is not None else 0.0,
            kernel_compile_s=self.loaded.kernel_compile_s,
            lora_enabled=self.lora is not None,
            lora_adapters={} if self.lora is None else self.lora.named,  # the registry's own: kept current
            reproducibility=fingerprint.reproducibility(self),
            system_fingerprint=self._fingerprints.get(None, ""),  # once asked for: hashing reads the files
        )
        self.scheduler.counters = self.stats.counters
        if self.lora is not None:
            self.lora.counters = self.stats.adapter_counters
        self.grammars.counters = self.stats.structured
        self._pool_base = self._pool_counts()

    def system_fingerprint(self, adapter: str | None = None) -> str:
        """The hash of what decides this engine's records (docs/reproducibility.md): the base model's
        (then also in `stats`), or with a loaded adapter's files; computed once each, on first use (it
        reads a checkpoint folder's files)."""
        if adapter not in self._fingerprints:
            self._fingerprints[adapter] = fingerprint.system_fingerprint(self, adapter)
        if adapter is None:
            self.stats.system_fingerprint = self._fingerprints[None]
        return self._fingerprints[adapter]

    def _pool_counts(self) -> tuple[int, ...]:
        p = self.pool
        return p.num_cow_copies, p.prefix_queries, p.prefix_hits, p.blocks_reused, p.evictions

    def enable_trace(self) -> None:
        self.trace = []
        self.pool.events = []

    # -- requests ---------------------------------------------------------------------------
    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """A text longer than this cannot fit the context: no token spans more characters than the
        tokenizer's longest vocabulary entry (a generous bound, so a huge line is refused without
        tokenizing it)."""
        tok = self.loaded.tokenizer
        longest = max((len(t) for t in tok.get_vocab()), default=1) if tok is not None else 1
        return self.max_model_len * max(longest, 1)

    def add_lora(self, request: LoRARequest) -> LoadedAdapter:
        """Read and check an adapter now (``pagedinfer run --lora``). Raises `AdapterError`."""
        if self.lora is None:
            raise AdapterError("LoRA is not enabled (enable_lora=True)")
        return self.lora.add(request)

    def draw_seed(self) -> int:
        """The base seed of a request that gives none: the next of the engine's seeded stream."""
        return self._seeds.getrandbits(62)

    def add_request(self, prepared: EngineRequest | Rejected, order: int) -> Request:
        """Queue a request intake prepared (`engine.intake.prepare`), as it is: nothing is checked again.

        A `Rejected` one comes back already finished with ``error`` set. ``order`` numbers the
        request for its caller (outputs are matched back by it).
        """
        self.stats.requests += 1
        if isinstance(prepared, Rejected):
            self.stats.failed_requests += 1
            req = Request(
                prepared.request_id, order, prepared.prompt, prepared.prompt_token_ids, SamplingParams(), 0
            )
            req.error = prepared.reason
            req.state = RequestState.FINISHED
            if isinstance(b := prepared.params, BeamSearchParams):  # answered as a beam search
                req.beam = BeamSearch(b.beam_width, 0, b.length_penalty, b.early_stopping, frozenset())
            return req
        params = prepared.params
        req = Request(
            request_id=prepared.request_id,
            order=order,
            prompt=prepared.prompt,
            prompt_token_ids=prepared.prompt_token_ids,
            params=params,
            max_tokens=prepared.max_tokens,
            lora=prepared.lora,
            cap=prepared.cap,
        )
        req.completion_state = functools.partial(self._new_completion, req, prepared.seed)
        if (beam := prepared.beam) is not None:
            stops = set(params.stop_token_ids) | (set() if beam.ignore_eos else self.loaded.eos_token_ids)
            req.beam = BeamSearch(
                beam.beam_width, req.max_tokens, beam.length_penalty, beam.early_stopping, frozenset(stops)
            )
        self.stats.prompt_tokens += req.num_prompt_tokens
        self.stats.prompt_tokens_requested += req.num_prompt_tokens * params.n
        self.stats.completions += params.n
        self.stats.lora_use(req.lora).add_request(req.num_prompt_tokens)
        self.scheduler.add(req)
        return req

    def _new_completion(
        self, req: Request, base_seed: int, index: int
    ) -> tuple[torch.Generator, IncrementalDetokenizer | None, LogitsState | None]:
        """Completion ``index``'s random source, detokenizer and processor states (a grammar matcher),
        made when the scheduler creates the completion (`Request.completion_state`)."""
        tok, p = self.loaded.tokenizer, req.params
        gen = torch.Generator()
        gen.manual_seed(completion_seed(base_seed, index, req.prompt_token_ids))
        state = self.logits.new_state(p) if p.shapes_logits else None
        if tok is None:
            return gen, None, state
        detok = IncrementalDetokenizer(
            tok.backend_tokenizer,
            req.prompt_token_ids,
            p.skip_special_tokens,
            p.stop,
            p.include_stop_str_in_output,
        )
        return gen, detok, state

    def abort_all(self) -> None:
        """Drop every unfinished request and return its blocks to the pool."""
        self.scheduler.abort_all()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one batch; return the requests that finished in it (failed ones included)."""
        start = monotonic()
        plan = self.scheduler.schedule()  # who runs, which blocks, which logits row feeds whom
        for req in self.scheduler.running:
            if req.started_s is None:  # admitted in this step
                req.started_s = start
        self._record(plan)
        sampled, beams, prompt = None, None, None
        if plan.batch:
            # what the processors and the sampler read of each sequence that receives a token
            every = [
                SampleRow(s.request.params, s.token_ids, s.num_prompt_tokens, s.logits_state, s.generator)
                for s in (t.seq for t in (*plan.targets, *plan.beam_targets))
            ]
            self.logits.prepare(every)  # grammar masks, overlapping the forward pass
            rows, beam_rows = every[: len(plan.targets)], every[len(plan.targets) :]
            logits = self.runner.execute(plan.batch, plan.copies)  # [plan.num_rows, V]
            self.stats.graph_steps += self.runner.last_step_graphed
            if plan.targets:
                sampled = self._sample(logits, plan.targets, rows)
            if plan.beam_targets:
                beams = self._beam_candidates(logits, plan.beam_targets, beam_rows)
            if plan.prompt_rows:
                prompt = self._prompt_logprobs(logits, plan.prompt_rows)
        finished = self.scheduler.update(
            plan, sampled, beams, prompt
        )  # computed, forks, appends, stops, frees
        for r in finished:
            if not r.error:
                self.stats.completion_tokens += r.completion_tokens()
                self.stats.lora_use(r.lora).completion_tokens += r.completion_tokens()
        if self.config.line_timeout is not None:
            self._cap_overdue(monotonic() - self.config.line_timeout)
        if self.trace is not None:
            self.trace.append(snapshot(len(self.trace), plan, self.pool, self.scheduler.running))
            self.pool.events.clear()
        return finished

    def _sample(
        self, logits: torch.Tensor, targets: list[SampleTarget], rows: list[SampleRow]
    ) -> SampleResult:
        """One token per target (a step that raises here is isolated by the generation loop); a row a
        constraint leaves no token fails its request alone."""
        at = [t.row for t in targets]
        if at != list(range(logits.shape[0])):  # forked completions share their prompt's row
            logits = logits[torch.tensor(at, device=logits.device)]  # [len(targets), V]
        result = sample(logits, rows, self.logits)
        for i in result.no_token:
            self.scheduler.fail(targets[i].seq.request, _no_token_reason(rows[i].params))
        for bad in result.nonfinite:
            seq = targets[bad.row].seq
            req = seq.request
            where = f"generated token {seq.num_output_tokens + 1}"
            if req.params.n > 1:
                where += f" of completion {seq.index}"
            self._fail_nonfinite(req, bad.found, where, bad.controls)
        return result

    def _fail_nonfinite(self, req: Request, found: str, where: str, controls: str | None = None) -> None:
        """Fail ``req`` for a logits row with NaN or infinite values (once: its other rows say the same)."""
        if req.state is RequestState.FINISHED:
            return
        adapter = None if req.lora is None else req.lora.name
        self.scheduler.fail(req, _nonfinite_reason(found, where, controls, adapter))

    @torch.inference_mode()
    def _prompt_logprobs(
        self, logits: torch.Tensor, chunks: list[PromptRows]
    ) -> list[list[dict[int, Logprob]]]:
        """Each prompt chunk's entries: row ``j`` gives the logprob of prompt token ``start + j + 1``. A
        row with NaN or infinite logits fails its request (its chunk gives no entries)."""
        out = []
        for c in chunks:
            req = c.request
            m = min(c.num_tokens, req.num_prompt_tokens - 1 - c.start)  # the prompt's last row gives none
            entries: list[dict[int, Logprob]] = []
            for lo in range(0, max(m, 0), PROMPT_LOGPROB_SLICE):  # log-softmax temporaries of a few rows
                if req.state is RequestState.FINISHED:
                    break
                hi = min(m, lo + PROMPT_LOGPROB_SLICE)
                tokens = req.prompt_token_ids[c.start + 1 + lo : c.start + 1 + hi]
                rows = logits[c.first_row + lo : c.first_row + hi]  # [hi - lo, V]
                ids = torch.tensor(tokens, device=logits.device)  # [hi - lo]
                found = logprob_entries(rows, ids, [req.params.prompt_logprobs] * len(tokens))
                if (j := next((j for j, e in enumerate(found) if e is None), None)) is not None:
                    where = f"prompt token {c.start + lo + j + 2} of {req.num_prompt_tokens}"
                    self._fail_nonfinite(req, found_words(float(rows[j].amax())), where)
                    break
                entries += found
            out.append(entries)
        return out

    def _beam_candidates(
        self, logits: torch.Tensor, targets: list[SampleTarget], rows: list[SampleRow]
    ) -> dict[Request, list[Candidate]]:
        """Each beam search's best continuations over all its live beams (their rows are in ``targets``)."""
        groups: dict[Request, list[int]] = {}
        for i, t in enumerate(targets):
            groups.setdefault(t.seq.request, []).append(i)
        out = {}
        for req, members in groups.items():
            beam_rows = [rows[i] for i in members]
            shaped = req.params.shapes_logits
            found = beam_candidates(
                logits[torch.tensor([targets[i].row for i in members], device=logits.device)],  # [beams, V]
                [targets[i].seq.cumulative_logprob for i in members],
                req.beam.num_candidates,
                (lambda scores, r=beam_rows: self.logits.apply(scores, r)) if shaped else None,
            )
            if isinstance(found, NonFinite):
                seq = targets[members[found.row]].seq
                self._fail_nonfinite(req, found.found, f"generated token {seq.num_output_tokens + 1}")
                continue
            out[req] = [Candidate(*c) for c in found]
        return out

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
                    capped_by=req.cap if h.finish_reason == "length" else None,  # a search ends all at once
                )
                for h in req.beam.finished
            ],
            error=req.error,
        )

    def _cap_overdue(self, started_before: float) -> None:
        """``line_timeout``: requests admitted before ``started_before`` (preempted ones included) end
        at their next token, marked."""
        for req in (*self.scheduler.running, *self.scheduler.waiting):
            if req.started_s is not None and req.started_s < started_before and req.cap != "line_timeout":
                req.cap_at_next_token("line_timeout")

    def started_requests(self) -> list[StartedRequest]:
        """The unfinished requests that have been admitted (their prompt computed or being computed),
        longest running first: what a progress record names and what a stop interrupts."""
        now = monotonic()
        started = [r for r in (*self.scheduler.running, *self.scheduler.waiting) if r.started_s is not None]
        started.sort(key=lambda r: r.started_s)
        return [StartedRequest(r.request_id, r.tokens_so_far(), now - r.started_s) for r in started]

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
        st = self.stats
        (
            st.cow_copies,
            st.prefix_cache_queries,
            st.prefix_cache_hits,
            st.prefix_cache_blocks_reused,
            st.prefix_cache_evictions,
        ) = (now - base for now, base in zip(self._pool_counts(), self._pool_base, strict=True))

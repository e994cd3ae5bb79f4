"""The engine: requests in, then steps until done, each ``schedule()`` -> the model and the sampler ->
``update_from_output()`` (vLLM v1's shape: the scheduler makes every state change of a step)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from time import monotonic, perf_counter

import torch

from pagedinfer.attention.interface import select_cuda_kernels
from pagedinfer.attention.kv_cache import KVCache, bytes_per_slot, group_layers
from pagedinfer.config import EngineConfig
from pagedinfer.core.beam import BeamSearch, Candidate
from pagedinfer.core.block_pool import BlockPool
from pagedinfer.core.kv_cache_manager import KVCacheManager
from pagedinfer.core.limits import RequestLimits
from pagedinfer.core.scheduler import ModelOutput, PromptRows, SampleTarget, Scheduler, SchedulerOutput
from pagedinfer.core.sequence import KeptCompletion, Request, RequestState
from pagedinfer.core.speculative import RowCost, Speculator
from pagedinfer.engine import fingerprint
from pagedinfer.engine.completion_state import CompletionStates
from pagedinfer.engine.draft_model import DraftModel, check_vocabulary, draft_bytes_per_block
from pagedinfer.engine.intake import EngineRequest, Intake, Rejected
from pagedinfer.engine.row_cost import measure_step_times
from pagedinfer.engine.stats import EngineStats
from pagedinfer.logits.controls import AllowedTokens, BadWords, LogitBias, MinTokens, Penalties
from pagedinfer.logits.processor import LogitsPipeline
from pagedinfer.logits.structured import GrammarCompiler, GrammarProcessor
from pagedinfer.lora.adapter import AdapterError
from pagedinfer.lora.registry import AdapterRegistry, LoadedAdapter
from pagedinfer.lora.request import LoRARequest
from pagedinfer.model.cuda_graphs import GRAPH_MAX_CONTEXT, DecodeGraphs
from pagedinfer.model.dtype import dtype_name
from pagedinfer.model.loader import LoadedModel, ModelLoadError, load_model
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

PROMPT_LOGPROB_SLICE = 128  # prompt logits rows normalised at once


@dataclass
class StartedRequest:
    """An unfinished request that has started: its id, the tokens its completions hold, for how long."""

    request_id: str
    tokens: int
    running_s: float


class SpeculationOff(UserWarning):
    """``speculative_config`` given on a path where a row's bits may depend on the rows beside it (outside
    the reproducibility contract): speculation would change outputs, so the engine runs without it.
    Also a draft model for a target whose first layer group is windowed (its blocks hold no whole
    context for the draft's K/V)."""


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


def _sample_rows(targets: list[SampleTarget]) -> list[SampleRow]:
    """What the processors and the sampler read of each target's sequence (one that receives a
    token), as it is now."""
    return [
        SampleRow(s.request.params, s.token_ids, s.num_prompt_tokens, s.logits_state, s.generator)
        for s in (t.seq for t in targets)
    ]


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
        groups = group_layers(loaded.layer_shapes, self.max_model_len)  # by attention window
        self.speculation_mode = "off"
        draft = self._load_draft_model(groups[0].window)
        per_block = bytes_per_slot(loaded.layer_shapes, groups, kv_dtype) * config.block_size
        if draft is not None:  # a block holds the draft's layers beside the target's: one budget
            per_block += draft_bytes_per_block(draft, config.block_size, config.kv_dtype(draft.dtype))
        self.pool_size = config.pool_size(per_block, loaded.device, self.max_model_len, len(groups))
        num_blocks = self.pool_size.num_blocks
        windows = tuple(g.window for g in groups)
        kv_cache_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, windows
        )
        null_block = kv_cache_manager.pool.null_block  # num_blocks, where a group is windowed
        kernels = select_cuda_kernels(
            use_cuda_kernels, loaded.device, loaded.layer_shapes, loaded.dtype, config.block_size, kv_dtype
        )
        graphs, self.graph_mode = graph_plan(
            loaded.device, kernels, config.enforce_eager, graph_buffers_on_cpu
        )
        # the tensors hold the pool's blocks, then its null block (a windowed group) and, with graphs,
        # the padding rows' scratch block
        scratch = num_blocks + int(null_block is not None)
        self.kv = KVCache(
            loaded.layer_shapes,
            scratch + int(graphs),
            config.block_size,
            kv_dtype,
            loaded.device,
            groups,
            null_block,
        )
        self.lora: AdapterRegistry | None = None  # the adapters, when LoRA is enabled
        if config.enable_lora:
            sites = attach_sites(loaded.model, loaded.impl, loaded.device)
            self.lora = AdapterRegistry(sites, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        self.runner = ModelRunner(loaded.model, self.kv, loaded.device, kernels, loaded.impl)
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
        self.scheduler = Scheduler(
            kv_cache_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            eos,
            config.schedule_policy,
            adapters=self.lora,
            completion_states=CompletionStates(tok, self.logits),
            line_timeout=config.line_timeout,
            clock=monotonic,  # the engine's: requests' running times are read on it too
        )
        limits = RequestLimits(
            self.max_model_len,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            num_blocks,
            config.block_size,
            context_set_by_option=self.max_model_len < loaded.max_model_len,
            num_groups=len(groups),
        )
        self.intake = Intake(
            tok,
            loaded.name,
            vocab,
            eos,
            limits,
            self.logits,
            self.lora,
            max_logprobs=config.max_logprobs,
            max_line_tokens=config.max_line_tokens,
            seed=config.seed,
        )
        if graphs:
            self._start_graphs(scratch)
        self.drafter: DraftModel | None = None  # the draft model (method draft_model), its K/V in the pool
        if draft is not None:
            self.drafter = self._drafter(draft)
        if config.speculative_config is not None and not self.speculation_mode.startswith("off:"):
            self.scheduler.speculator = self._speculator()
        self._fingerprints: dict[str | None, str] = {}  # by adapter name (None: the base model)
        self.reset_stats()

    def _start_graphs(self, scratch_block: int) -> None:
        """Decode steps through static buffers; on CUDA their graphs captured now (the time is reported).
        A failed capture leaves every step eager and says why."""
        graphs = DecodeGraphs(
            self.runner.run_model,
            self.kv,
            self.loaded.device,
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

    def _speculator(
        self, cost: RowCost | None = None, draft_cost: RowCost | None = None
    ) -> Speculator | None:
        """Speculation as configured, where it changes no bit (on the path the reproducibility contract
        covers, whose rows do not depend on their neighbours); else None, with a warning saying why.
        ``cost``: the drafted rows' cost, fixed (None: measured now on the loaded model, then refit from
        the run's decode steps). ``draft_cost``: the draft model's passes' in the same units (with a
        fixed ``cost``: free when not given; else its passes' times, measured when it was loaded)."""
        spec = self.config.speculative_config
        covered = fingerprint.reproducibility(self)
        if not covered.covered:
            self.drafter = None  # its tensors go; its share of the pool's budget stays counted
            self.speculation_mode = f"off: {covered.why} (a row's bits may depend on its batch)"
            warnings.warn(f"speculative decoding {self.speculation_mode}", SpeculationOff, stacklevel=3)
            return None
        method = spec.method
        if method == "draft_model":
            method += f" {self.drafter.loaded.name}"
        self.speculation_mode = f"on: {method}, up to {spec.num_speculative_tokens} drafted tokens"
        if cost is not None and self.drafter is not None:
            draft_cost = draft_cost or RowCost(0.0, scale=0.0)
        return Speculator(
            spec,
            cost or measure_step_times(self.runner, self.pool, spec.num_speculative_tokens),
            self.drafter,
            draft_cost,
        )

    def _load_draft_model(self, first_window: int) -> LoadedModel | None:
        """The configured draft model on the target's device, loaded before the pool is sized (its
        K/V share the pool's blocks and budget); refused (`ModelLoadError`, naming both models) where
        its vocabulary differs. None without one, off the CPU, or where the target's first layer
        group is windowed: the draft's K/V follow that group's block table, whose released blocks
        would leave the draft's lagging positions nowhere to go (speculation off, `SpeculationOff`)."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model" or self.loaded.device.type != "cpu":
            return None  # off the CPU, outside the reproducibility contract: `_speculator` turns it off
        if first_window:
            self.speculation_mode = (
                "off: a draft model needs a target whose first layer group holds the whole context "
                f"(its layers attend through a window of {first_window:,} tokens)"
            )
            warnings.warn(f"speculative decoding {self.speculation_mode}", SpeculationOff, stacklevel=4)
            return None
        try:
            loaded = load_model(spec.model, device=str(self.loaded.device))
        except ModelLoadError as e:
            raise ModelLoadError(f"speculative_config.model: the draft model {spec.model!r}: {e}") from None
        check_vocabulary(self.loaded, loaded)
        return loaded

    def _drafter(self, loaded: LoadedModel) -> DraftModel:
        """The draft model over the target's pool, its K/V tensors a row per row of the target's, its
        passes' times seeded now."""
        drafter = DraftModel(loaded, self.pool, self.kv.num_blocks, self.config.kv_dtype(loaded.dtype))
        k = self.config.speculative_config.num_speculative_tokens
        drafter.times = measure_step_times(drafter.runner, self.pool, k)
        return drafter

    def set_row_cost(self, cost: RowCost, draft_cost: RowCost | None = None) -> None:
        """Replace the measured cost of drafted rows (tests: ``RowCost(math.inf)`` drafts every match)
        and of the draft model's passes (in the same units; None: free)."""
        if self.scheduler.speculator is not None:
            self.scheduler.speculator = self._speculator(cost, draft_cost)

    @property
    def pool(self) -> BlockPool:
        """The KV block pool (its use: ``num_used``, ``num_blocks``), the scheduler's KV-cache manager's."""
        return self.scheduler.kv_cache_manager.pool

    @property
    def trace(self) -> list[dict] | None:
        """The per-step pool snapshots (`core.trace`), once `enable_trace` was called."""
        return self.scheduler.trace

    def enable_trace(self) -> None:
        self.scheduler.enable_trace()

    @property
    def stats(self) -> EngineStats:
        """This run's figures: the engine's own record with its parts' snapshots as of now."""
        s = self._stats
        scheduler = self.scheduler.make_stats()
        s.counters, s.kv = scheduler.counters, scheduler.kv
        s.speculation = scheduler.speculation
        s.structured = self.grammars.make_stats()
        if self.lora is not None:
            s.adapter_counters = self.lora.make_stats()
            s.lora_adapters = dict(self.lora.named)
        return s

    def reset_stats(self) -> None:
        """Start a run's figures: the engine's record afresh, every part's counts from zero. A block's
        bytes are the target's layers' and the draft model's."""
        draft_bytes = self.drafter.kv.bytes_per_block if self.drafter is not None else 0
        self._stats = EngineStats(
            num_blocks=self.pool.num_blocks,
            block_size=self.pool.block_size,
            bytes_per_token=self.kv.bytes_per_token + draft_bytes // self.pool.block_size,
            bytes_per_block=self.kv.bytes_per_block + draft_bytes,
            layer_groups=tuple((g.window, g.layers) for g in self.kv.groups),
            pool_size=self.pool_size,
            max_model_len=self.max_model_len,
            prefix_caching=self.pool.enable_prefix_caching,
            schedule_policy=self.config.schedule_policy,
            dtype=dtype_name(self.loaded.dtype),
            dtype_reason=self.loaded.dtype_reason,
            dtype_emulated=self.loaded.dtype_emulated,
            matmul_numerics=self.loaded.matmul_numerics,
            kv_cache_dtype=dtype_name(self.kv.dtype),
            weight_bytes=self.loaded.weights.bytes,
            linear_bits_per_weight=self.loaded.weights.linear_bits_per_weight,
            cuda_graphs=self.graph_mode,
            speculation_mode=self.speculation_mode,
            graph_capture_s=self.runner.graphs.capture_s if self.runner.graphs is not None else 0.0,
            kernel_compile_s=self.loaded.kernel_compile_s,
            lora_enabled=self.lora is not None,
            reproducibility=fingerprint.reproducibility(self),
            system_fingerprint=self._fingerprints.get(None, ""),  # once asked for: hashing reads the files
        )
        self.scheduler.reset_stats()
        self.grammars.reset_stats()
        if self.lora is not None:
            self.lora.reset_stats()

    def system_fingerprint(self, adapter: str | None = None) -> str:
        """The hash of what decides this engine's records (docs/reproducibility.md): the base model's
        (then also in `stats`), or with a loaded adapter's files; computed once each, on first use (it
        reads a checkpoint folder's files)."""
        if adapter not in self._fingerprints:
            self._fingerprints[adapter] = fingerprint.system_fingerprint(self, adapter)
        if adapter is None:
            self._stats.system_fingerprint = self._fingerprints[None]
        return self._fingerprints[adapter]

    # -- requests ---------------------------------------------------------------------------
    def add_lora(self, request: LoRARequest) -> LoadedAdapter:
        """Read and check an adapter now (``pagedinfer run --lora``). Raises `AdapterError`."""
        if self.lora is None:
            raise AdapterError("LoRA is not enabled (enable_lora=True)")
        return self.lora.add(request)

    def add_request(self, prepared: EngineRequest | Rejected, order: int) -> Request:
        """Queue a request intake prepared (`Intake.prepare`), as it is: nothing is checked again.

        A `Rejected` one comes back already finished with ``error`` set. ``order`` numbers the
        request for its caller (outputs are matched back by it).
        """
        if isinstance(prepared, Rejected):
            req = Request(
                prepared.request_id, order, prepared.prompt, prepared.prompt_token_ids, SamplingParams(), 0
            )
            req.error = prepared.reason
            req.state = RequestState.FINISHED
            if isinstance(b := prepared.params, BeamSearchParams):  # answered as a beam search
                req.beam = BeamSearch(b.beam_width, 0, b.length_penalty, b.early_stopping, frozenset())
            self._stats.count_added(req)
            return req
        params = prepared.params
        req = Request(
            request_id=prepared.request_id,
            order=order,
            prompt=prepared.prompt,
            prompt_token_ids=prepared.prompt_token_ids,
            params=params,
            max_tokens=prepared.max_tokens,
            seed=prepared.seed,
            lora=prepared.lora,
            cap=prepared.cap,
        )
        if (beam := prepared.beam) is not None:
            stops = set(params.stop_token_ids) | (set() if beam.ignore_eos else self.loaded.eos_token_ids)
            req.beam = BeamSearch(
                beam.beam_width, req.max_tokens, beam.length_penalty, beam.early_stopping, frozenset(stops)
            )
        elif prepared.kept:
            req.kept = self._usable(prepared.kept, params)
        self._stats.count_added(req)
        self.scheduler.add(req)
        return req

    def _usable(self, kept: dict[int, KeptCompletion], params: SamplingParams) -> dict | None:
        """``kept`` when each of its completions can be replayed as this request's (an index below n,
        token ids in the vocabulary, an entry with its own token per token where logprobs are asked
        for); else None: the request runs from its prompt."""
        for index, k in kept.items():
            ok = 0 <= index < params.n and all(0 <= t < self.vocab_size for t in k.token_ids)
            if params.logprobs is not None:
                ok = ok and k.logprobs is not None and len(k.logprobs) == len(k.token_ids)
                ok = ok and all(t in top for t, top in zip(k.token_ids, k.logprobs or (), strict=False))
            if not ok:
                return None
        return kept

    def generating(self) -> dict[int, Request]:
        """The unfinished requests whose completions hold generated tokens, by ``order``: what
        ``--resume`` keeps of a line mid-generation (a beam search's beams are not kept: it reruns)."""
        return {
            r.order: r
            for r in (*self.scheduler.running, *self.scheduler.waiting)
            if r.beam is None and r.error is None and r.sampled_yet
        }

    def abort_all(self) -> None:
        """Drop every unfinished request and return its blocks to the pool."""
        self.scheduler.abort_all()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one batch; return the requests that finished in it (failed ones included)."""
        start = perf_counter()
        plan = self.scheduler.schedule()  # who runs, which blocks, which logits row feeds whom
        self._stats.record_step(self.scheduler.make_stats(), plan.num_tokens)
        output = self._execute(plan) if plan.batch else ModelOutput()
        finished = self.scheduler.update_from_output(plan, output)  # computed, forks, appends, stops, frees
        self._stats.count_finished(finished)
        speculator = self.scheduler.speculator
        if (
            speculator is not None
            and plan.batch
            and all(s.num_tokens == 1 + len(s.draft) for s in plan.batch)
        ):
            speculator.observe(plan.num_tokens, perf_counter() - start)  # a decode step: the gate's times
        return finished

    def _execute(self, plan: SchedulerOutput) -> ModelOutput:
        """The forward pass, then each target's token, each beam search's candidates and each prompt
        chunk's logprobs; a logits row that gives none fails its request (`ModelOutput.failed`)."""
        out = ModelOutput()
        every = _sample_rows([*plan.targets, *plan.beam_targets])
        self.logits.prepare(every)  # grammar masks, overlapping the forward pass
        rows, beam_rows = every[: len(plan.targets)], every[len(plan.targets) :]
        logits = self.runner.execute(plan.batch, plan.copies)  # [plan.num_rows, V]
        self._stats.graph_steps += self.runner.last_step_graphed
        if plan.targets:
            out.sampled = self._sample(logits, plan.targets, rows, out.failed)
            out.verify = partial(self._verify, logits)
        if plan.beam_targets:
            out.beams = self._beam_candidates(logits, plan.beam_targets, beam_rows, out.failed)
        if plan.prompt_rows:
            out.prompt_logprobs = self._prompt_logprobs(logits, plan.prompt_rows, out.failed)
        return out

    def _sample(
        self,
        logits: torch.Tensor,
        targets: list[SampleTarget],
        rows: list[SampleRow],
        failed: dict[Request, str],
    ) -> SampleResult:
        """One token per target (a step that raises here is isolated by the generation loop); a row a
        constraint leaves no token fails its request alone (added to ``failed``)."""
        at = [t.row for t in targets]
        if at != list(range(logits.shape[0])):  # forked completions share their prompt's row
            logits = logits[torch.tensor(at, device=logits.device)]  # [len(targets), V]
        result = sample(logits, rows, self.logits)
        for i in result.no_token:
            failed.setdefault(targets[i].seq.request, _no_token_reason(rows[i].params))
        for bad in result.nonfinite:
            seq = targets[bad.row].seq
            req = seq.request
            where = f"generated token {seq.num_output_tokens + 1}"
            if req.params.n > 1:
                where += f" of completion {seq.index}"
            self._fail_nonfinite(failed, req, bad.found, where, bad.controls)
        return result

    def _verify(
        self, logits: torch.Tensor, targets: list[SampleTarget]
    ) -> tuple[SampleResult, dict[Request, str]]:
        """The next token of sequences whose drafted tokens matched so far, each from its drafted
        position's row (``target.row``), with its state as it is now: as without speculation."""
        rows = _sample_rows(targets)
        self.logits.prepare(rows)
        failed: dict[Request, str] = {}
        return self._sample(logits, targets, rows, failed), failed

    def _fail_nonfinite(
        self, failed: dict[Request, str], req: Request, found: str, where: str, controls: str | None = None
    ) -> None:
        """Fail ``req`` for a logits row with NaN or infinite values (once: its other rows say the same)."""
        adapter = None if req.lora is None else req.lora.name
        failed.setdefault(req, _nonfinite_reason(found, where, controls, adapter))

    @torch.inference_mode()
    def _prompt_logprobs(
        self, logits: torch.Tensor, chunks: list[PromptRows], failed: dict[Request, str]
    ) -> list[list[dict[int, Logprob]]]:
        """Each prompt chunk's entries: row ``j`` gives the logprob of prompt token ``start + j + 1``. A
        row with NaN or infinite logits fails its request (its chunk gives no entries)."""
        out = []
        for c in chunks:
            req = c.request
            m = min(c.num_tokens, req.num_prompt_tokens - 1 - c.start)  # the prompt's last row gives none
            entries: list[dict[int, Logprob]] = []
            for lo in range(0, max(m, 0), PROMPT_LOGPROB_SLICE):  # log-softmax temporaries of a few rows
                if req in failed:
                    break
                hi = min(m, lo + PROMPT_LOGPROB_SLICE)
                tokens = req.prompt_token_ids[c.start + 1 + lo : c.start + 1 + hi]
                rows = logits[c.first_row + lo : c.first_row + hi]  # [hi - lo, V]
                ids = torch.tensor(tokens, device=logits.device)  # [hi - lo]
                found = logprob_entries(rows, ids, [req.params.prompt_logprobs] * len(tokens))
                if (j := next((j for j, e in enumerate(found) if e is None), None)) is not None:
                    where = f"prompt token {c.start + lo + j + 2} of {req.num_prompt_tokens}"
                    self._fail_nonfinite(failed, req, found_words(float(rows[j].amax())), where)
                    break
                entries += found
            out.append(entries)
        return out

    def _beam_candidates(
        self,
        logits: torch.Tensor,
        targets: list[SampleTarget],
        rows: list[SampleRow],
        failed: dict[Request, str],
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
                self._fail_nonfinite(failed, req, found.found, f"generated token {seq.num_output_tokens + 1}")
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

    def started_requests(self) -> list[StartedRequest]:
        """The unfinished requests that have been admitted (their prompt computed or being computed),
        longest running first: what a progress record names and what a stop interrupts."""
        now = monotonic()
        started = [r for r in (*self.scheduler.running, *self.scheduler.waiting) if r.started_s is not None]
        started.sort(key=lambda r: r.started_s)
        return [StartedRequest(r.request_id, r.tokens_so_far(), now - r.started_s) for r in started]

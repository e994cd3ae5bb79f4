"""Continuous batching, and every state change of a step: ``schedule()`` before the forward pass,
``update_from_output()`` after it (vLLM v1's names).

Each step serves running requests first (decode tokens, prompt chunks, recomputation), then admits
waiting requests while the token budget, the sequence limit and the free blocks allow, in the order
the admission policy gives (`core.admission`: ``lpm`` or ``fcfs``, the starvation bound, the LoRA
adapters' slots). An admitted prompt starts from its longest cached prefix (prefix caching).

The KV-cache manager (`core.kv_cache_manager`, owned here) answers for the blocks: a request's share
of the step is built sequence by sequence, each granted its slots (`KVCacheManager.allocate`), and
added to the plan only once all are granted. When a running sequence needs a block and none is
free, the most recently admitted request is preempted as a whole (its blocks freed, recomputed
later), never failed; when that is the request itself, its share never reaches the plan.

The plan names, for every sequence that receives a token this step, the logits row it samples
from; the engine only runs the model and the sampler in between and hands back a `ModelOutput`.
``update_from_output`` then fails the requests a logits row failed, marks tokens computed, forks
finished prompts into their completions, appends the sampled tokens, detects stops, frees what
finished and caps the requests past ``line_timeout``. No other module writes a sequence's state.

Speculative decoding (`core.speculative`, when a `Speculator` is given): a decoding sequence's share
may carry drafted tokens after its pending one, written into its own blocks (a shared block copied
first, as any write) but only where free blocks cover them (a draft never preempts), each with its
logits row. ``update_from_output`` appends the token drawn from the first row, and while it equals the
next drafted token (and ends nothing), the token drawn from the next row (`ModelOutput.verify`: the
engine draws it with the sequence's state as it is then, so each token is the one it would have
been without speculation, from the same random number); the rejected tail is rolled back
(`KVCacheManager.truncate`) before any block is hashed.

Prompt logprobs (``SamplingParams.prompt_logprobs``): a prompt chunk of such a request returns the
logits of every position it computes (at most `MAX_PROMPT_LOGPROB_ROWS` rows a step, so memory
stays bounded for any prompt length); ``update_from_output`` takes each position's entry for the
token after it. The KV-cache manager keeps the entries of a full block beside its hash, so a later
request with the same prefix takes them with the cached block; it then computes again only the last
cached position (the one whose logits give the first uncached token's entry).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from pagedinfer.config import EngineConfig
from pagedinfer.core.admission import AdapterSlots, AdmissionPolicy
from pagedinfer.core.beam import Candidate
from pagedinfer.core.kv_cache_manager import KVCacheBlocks, KVCacheManager, KVCacheStats, PrefixHit
from pagedinfer.core.sequence import CompletionStates, Request, RequestState, Sequence
from pagedinfer.core.speculative import Draft, SpeculationStats, Speculator
from pagedinfer.core.trace import snapshot
from pagedinfer.lora.adapter import AdapterError
from pagedinfer.outputs import Logprob

MAX_PROMPT_LOGPROB_ROWS = 512  # logits rows prompt-logprob chunks return in one step (bounds memory)


@dataclass
class ScheduledSeq:
    """One sequence's share of the step: its tokens ``token_ids[start : start + num_tokens]``."""

    seq: Sequence
    start: int  # first position computed this step (= tokens already in the pool)
    num_tokens: int
    sample: bool  # the chunk ends the sequence's pending tokens: its last position's logits are kept
    num_logits: int = 0  # logits rows returned: its last num_logits positions (1 when it only samples)
    # drafted tokens after its pending one, counted in num_tokens: its `Draft`'s own list (a draft
    # model's are made into it once the step is planned, `Speculator.fill`)
    draft: list[int] | tuple[()] = ()

    @property
    def step_token_ids(self) -> list[int]:
        """The tokens this step computes: its pending ones, then the drafted ones."""
        end = self.start + self.num_tokens - len(self.draft)
        return self.seq.token_ids[self.start : end] + list(self.draft)


@dataclass
class PromptRows:
    """A prompt chunk's logits rows: row ``first_row + i`` is position ``start + i``'s, which gives the
    entry of prompt token ``start + i + 1``."""

    request: Request
    first_row: int
    start: int
    num_tokens: int


@dataclass
class SampleTarget:
    """A sequence that receives a token this step, and the logits row it is drawn from."""

    seq: Sequence
    row: int  # the n completions of a prompt completing this step share the prompt's row
    draft: Draft | None = None  # its drafted tokens: their rows follow ``row``, one per token


@dataclass
class SchedulerOutput:
    batch: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[Request] = field(default_factory=list)
    targets: list[SampleTarget] = field(default_factory=list)
    beam_targets: list[SampleTarget] = field(default_factory=list)  # live beams, all of a request together
    prompt_rows: list[PromptRows] = field(default_factory=list)  # chunks computing prompt logprobs
    num_rows: int = 0  # logits rows the runner returns: the scheduled seqs' num_logits

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.batch)


class Sampled(Protocol):
    """The sampler's result, one entry per target of the plan."""

    token_ids: list[int]
    logprobs: list[float | None]
    top: list[dict[int, Logprob] | None]


@dataclass
class SchedulerCounters:
    """Token and event counts since the last `Scheduler.reset_stats`."""

    prompt_tokens_computed: int = 0  # prompt tokens run through the model (recompute included)
    output_tokens_recomputed: int = 0  # generated tokens run again after a preemption
    output_tokens_restored: int = 0  # generated tokens a resumed completion found in the prefix cache
    output_tokens_kept: int = 0  # generated tokens an earlier run kept (--resume inside a line), replayed
    generated_tokens: int = 0
    preemptions: int = 0
    prompt_tokens_readmitted: int = 0  # prompt tokens of requests admitted again after a preemption


@dataclass
class ModelOutput:
    """What the engine hands back after the forward pass and the sampler (vLLM's ``ModelRunnerOutput``)."""

    sampled: Sampled | None = None  # one token per target of the plan
    beams: dict[Request, list[Candidate]] = field(default_factory=dict)  # each beam search's candidates
    # per entry of the plan's prompt_rows: the entries of the prompt tokens after its positions
    prompt_logprobs: list[list[dict[int, Logprob]]] = field(default_factory=list)
    failed: dict[Request, str] = field(default_factory=dict)  # requests a logits row fails, and why
    # drafts still matching: the next token of each target (its ``row`` the next drafted position's),
    # drawn as without speculation; with the requests such a row fails
    verify: Callable[[list[SampleTarget]], tuple[Sampled, dict[Request, str]]] | None = None


@dataclass
class SchedulerStats:
    """The scheduler's snapshot (vLLM's ``SchedulerStats``): what runs now, and the counts since the
    last reset."""

    running_seqs: int  # sequences the running requests occupy (completions not forked yet included)
    logical_blocks: int  # block-table entries of their live sequences
    counters: SchedulerCounters
    kv: KVCacheStats  # the KV-cache manager's
    speculation: SpeculationStats | None = None  # the speculator's, when speculation is on


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        schedule_policy: Literal["fcfs", "lpm"] = EngineConfig.schedule_policy,
        adapters: AdapterSlots | None = None,
        completion_states: CompletionStates | None = None,
        line_timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        speculator: Speculator | None = None,
    ) -> None:
        """``adapters``: the slots of the LoRA adapters requests name (None: no request names one).
        ``completion_states``: what each new completion starts with (None: no random source,
        detokenizer or logits state, as greedy token ids need none). ``line_timeout``: requests
        admitted longer ago than this (seconds of ``clock``) end at their next token. ``speculator``:
        drafts for decoding sequences (None: no speculation)."""
        self.kv_cache_manager = kv_cache_manager
        self.admission = AdmissionPolicy(kv_cache_manager, max_num_seqs, schedule_policy, adapters)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        self.completion_states = completion_states
        self.line_timeout = line_timeout
        self.clock = clock
        self.speculator = speculator
        # the step being scheduled, for the gate: its sequences when it began, its rows (one a sequence)
        # grown by the drafts granted so far, and the tokens they are expected to give
        self._num_seqs, self._step_rows, self._step_tokens = 0, 0, 0.0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.counters = SchedulerCounters()
        self.trace: list[dict] | None = None  # per-step pool snapshots, when enabled
        self._failed: list[Request] = []  # failed since the last update, which reports them
        self._logit_rows_left = MAX_PROMPT_LOGPROB_ROWS  # in the step being scheduled

    # -- requests -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def fail(self, req: Request, reason: str) -> None:
        """End ``req`` alone with ``reason`` (its blocks freed); the other requests go on.

        The next ``update_from_output`` returns it among the finished requests. A request fails once:
        a second reason (another of its rows failing in the same step) is dropped.
        """
        if req.state is RequestState.FINISHED:
            return
        req.error = reason
        self._finish(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self._failed.append(req)

    def abort_all(self) -> None:
        """Drop every unfinished request and return its blocks to the pool."""
        for req in [*self.running, *self.waiting]:
            self._finish(req)
        self.waiting.clear()
        self._failed.clear()

    # -- before the forward pass ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._logit_rows_left = MAX_PROMPT_LOGPROB_ROWS
        now = self.clock()
        self._num_seqs = self._step_rows = sum(len(r.live_seqs()) for r in self.running)
        self._step_tokens = float(self._num_seqs)
        for req in list(self.running):
            if req.state is not RequestState.RUNNING:
                continue  # preempted earlier in this step
            share = self._share(req, budget, out)
            if share is not None:  # else req preempted itself: it has no share
                budget -= self._commit(out, share)
        if not out.preempted:
            self._admit(out, budget, now)
        if self.speculator is not None:
            self.speculator.fill(out.batch)
        return out

    def _share(
        self, req: Request, budget: int, out: SchedulerOutput
    ) -> list[tuple[Sequence, int, KVCacheBlocks, Draft | None]] | None:
        """Each live sequence of running ``req`` with its tokens this step (within ``budget``, drafted
        ones included), the slots granted for them and its draft; None when granting them preempted
        ``req`` itself."""
        seqs = req.live_seqs()
        beams = req.beam is not None and req.prompt_seq is None
        together = beams and sum(s.num_pending for s in seqs) <= budget
        share = []
        for seq in seqs:
            n = self._chunk(seq, budget)
            if beams and not together:  # the beams' last tokens must run in one step
                n = min(n, seq.num_pending - 1)
            if n <= 0:
                continue
            draft, blocks = self._draft(seq, n, budget), None
            if draft is not None:  # only where free blocks cover it: a draft never preempts
                blocks = self.kv_cache_manager.allocate(seq, n + len(draft.token_ids))
                draft = draft if blocks is not None else None
            if draft is not None:
                self._step_rows += len(draft.token_ids)
                self._step_tokens += draft.expected
            if blocks is None:
                blocks = self._allocate(seq, n, req, out)
            if blocks is None:
                return None
            n += len(draft.token_ids) if draft is not None else 0
            share.append((seq, n, blocks, draft))
            budget -= n
        return share

    def _draft(self, seq: Sequence, n: int, budget: int) -> Draft | None:
        """A draft for ``seq`` when it decodes (one token pending; never a beam): at most the tokens
        left in the budget and before its ``max_tokens``. Not for a LoRA line: outside the
        reproducibility contract, its rows' bits may change with a draft's rows."""
        req = seq.request
        if self.speculator is None or seq.is_prompt or n != 1 or seq.num_pending != 1 or req.beam:
            return None
        if req.lora is not None:  # an adapter's deltas are torch GEMMs whose bits vary with the rows
            return None
        room = min(budget - 1, req.max_tokens - seq.num_output_tokens - 1)
        return self.speculator.propose(seq, room, self._num_seqs, self._step_rows, self._step_tokens)

    def _allocate(self, seq: Sequence, n: int, req: Request, out: SchedulerOutput) -> KVCacheBlocks | None:
        """Slots for ``seq``'s next ``n`` tokens, preempting the latest admitted requests while the free
        blocks fall short; None when ``req`` itself had to be preempted."""
        while (blocks := self.kv_cache_manager.allocate(seq, n)) is None:
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return None
        return blocks

    def _commit(
        self, out: SchedulerOutput, share: list[tuple[Sequence, int, KVCacheBlocks, Draft | None]]
    ) -> int:
        """Add a request's share to the plan; returns its tokens."""
        for seq, n, blocks, draft in share:
            out.copies += blocks.copies
            self._schedule(out, seq, n, draft)
        return sum(n for _, n, _, _ in share)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of ``seq`` this step can compute: its pending ones within the budget (and, for a
        prompt computing its logprobs, within the step's logits rows)."""
        n = min(seq.num_pending, budget)
        if seq.is_prompt and seq.request.needs_prompt_logprobs:
            n = min(n, self._logit_rows_left)
        return n

    def _schedule(self, out: SchedulerOutput, seq: Sequence, n: int, draft: Draft | None = None) -> None:
        """Add ``n`` tokens of ``seq`` to the plan (the ``draft``'s included), with the targets its
        logits rows feed (a drafted token's row follows the row of the token before it)."""
        req = seq.request
        k = len(draft.token_ids) if draft is not None else 0
        ends = seq.num_computed + n - k == len(seq.token_ids)
        targets = [seq] if not seq.is_prompt else [] if req.sampled_yet else req.completions
        sample = ends and bool(targets)  # a resumed request's completions recompute before they sample
        rows = int(sample) + k
        if seq.is_prompt and req.needs_prompt_logprobs:  # every position's logits, the last one sampled
            rows = n
            out.prompt_rows.append(PromptRows(req, out.num_rows, seq.num_computed, n))
            self._logit_rows_left -= n
        out.batch.append(ScheduledSeq(seq, seq.num_computed, n, sample, rows, draft.token_ids if k else ()))
        if sample:
            dest = out.targets if req.beam is None else out.beam_targets
            dest += [SampleTarget(t, out.num_rows + rows - 1 - k, draft) for t in targets]
        out.num_rows += rows

    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Admit waiting requests in the policy's order while they fit; each starts from its cached prefix."""
        if not self.waiting:
            return
        num_seqs = sum(r.num_future_seqs() for r in self.running)
        if budget <= 0 or num_seqs >= self.max_num_seqs:
            return
        kv = self.kv_cache_manager
        admission = self.admission.start(self.waiting, self.running)
        for pos, req in admission.order:
            if budget <= 0:
                break
            if self.running and num_seqs + req.num_future_seqs() > self.max_num_seqs:
                break
            if admission.waits_for_slot(req):
                continue
            hit = kv.lookup(req)
            if admission.waits_for_prefill(hit):
                continue
            if not kv.can_admit(req, hit):
                break
            if req.needs_prompt_logprobs and self._logit_rows_left <= 0:
                continue
            if req.lora is not None:
                try:
                    req.lora_slot = admission.take_slot(req)
                except AdapterError as e:
                    self.fail(req, f"lora: {e}")
                    continue
            admission.admit(pos, hit)
            n = self._start(req, hit, budget, out, now)
            num_seqs += req.num_future_seqs()
            budget -= n
        admission.close()

    def _start(self, req: Request, hit: PrefixHit, budget: int, out: SchedulerOutput, now: float) -> int:
        """Run ``req`` from its cached prefix ``hit`` and plan its first prompt chunk; returns the
        chunk's tokens. `KVCacheManager.can_admit` has counted the blocks of its whole prompt."""
        kv = self.kv_cache_manager
        self.waiting.remove(req)
        req.state = RequestState.RUNNING
        self.running.append(req)
        if req.started_s is None:
            req.started_s = now
        if req.num_preemptions:
            self.counters.prompt_tokens_readmitted += req.num_prompt_tokens
        if not req.completions:  # a beam search starts from one beam
            n = 1 if req.beam is not None else req.params.n
            req.completions = [self._new_completion(req, i) for i in range(n)]
            if req.kept:
                self._replay_kept(req)
        seq = Sequence(req, 0, True, list(req.prompt_token_ids), req.num_prompt_tokens)
        req.prompt_seq = seq
        kv.take_prefix(seq, hit)
        seq.num_computed = hit.num_computed
        if req.needs_prompt_logprobs:
            for pos, entry in enumerate(kv.cached_prompt_logprobs(req, hit)):
                if entry is not None and req.prompt_logprobs[pos] is None:
                    req.prompt_logprobs[pos] = entry
            req.prompt_logprobs_upto = max(req.prompt_logprobs_upto, len(hit.blocks) * kv.block_size)
        n = self._chunk(seq, budget)
        blocks = kv.allocate(seq, n)
        assert blocks is not None, "can_admit counted the whole prompt's blocks"
        out.copies += blocks.copies
        self._schedule(out, seq, n)
        return n

    def _new_completion(self, req: Request, index: int) -> Sequence:
        states = self.completion_states
        generator, detok, state = states(req, index) if states is not None else (None, None, None)
        return Sequence(
            request=req,
            index=index,
            is_prompt=False,
            token_ids=list(req.prompt_token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            generator=generator,
            detok=detok,
            logits_state=state,
            logprobs=[] if req.params.logprobs is not None else None,
        )

    def _replay_kept(self, req: Request) -> None:
        """Append each completion's kept tokens as if sampled now (their random numbers were drawn when
        its states were made): its stops, text and grammar state come out as the earlier run's. Kept
        tokens that end every completion, or that the replay refuses (a grammar, a stop token's
        entry missing), are dropped: the request runs from its prompt, as without them."""
        kept, req.kept = req.kept, None
        try:
            for seq in req.completions:
                k = kept.get(seq.index)
                for j, token in enumerate(k.token_ids if k is not None else ()):
                    if seq.finished:
                        raise ValueError("a kept completion goes on after its end")
                    top = None if k.logprobs is None else k.logprobs[j]
                    self._append(seq, token, None if top is None else top[token].logprob, top, count=False)
            if all(s.finished for s in req.completions):
                raise ValueError("nothing left to generate")
        except Exception:  # noqa: BLE001 - kept tokens that do not replay are dropped, never the request
            n = len(req.completions)
            req.completions = [self._new_completion(req, i) for i in range(n)]
            return
        self.counters.output_tokens_kept += req.tokens_so_far()

    def _preempt(self, req: Request) -> None:
        """Free every block of ``req`` and queue it first; its tokens are recomputed on return."""
        for seq in [req.prompt_seq, *req.completions]:
            if seq is not None:
                self.kv_cache_manager.free(seq)
                seq.num_computed = 0
        req.prompt_seq = None
        req.state = RequestState.WAITING
        req.num_preemptions += 1
        self.counters.preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    # -- after the forward pass -----------------------------------------------------------
    def update_from_output(self, plan: SchedulerOutput, output: ModelOutput) -> list[Request]:
        """Apply one step's result; return the requests that finished in it (failed ones included)."""
        kv = self.kv_cache_manager
        for req, reason in output.failed.items():
            self.fail(req, reason)
        finished: list[Request] = []
        for chunk, entries in zip(plan.prompt_rows, output.prompt_logprobs, strict=False):
            req = chunk.request
            if req.state is RequestState.FINISHED:
                continue
            for j, entry in enumerate(entries):
                if req.prompt_logprobs[chunk.start + 1 + j] is None:
                    req.prompt_logprobs[chunk.start + 1 + j] = entry
            req.prompt_logprobs_upto = max(req.prompt_logprobs_upto, chunk.start + 1 + len(entries))
        for s in plan.batch:
            seq, req = s.seq, s.seq.request
            if req.state is RequestState.FINISHED:
                continue  # failed after it was scheduled
            seq.num_computed += s.num_tokens - len(s.draft)  # drafted positions count once verified
            kv.cache_blocks(seq)
            if seq.is_prompt and req.params.prompt_logprobs is not None:
                kv.keep_prompt_logprobs(seq, s.start)
            if seq.is_prompt:
                self.counters.prompt_tokens_computed += s.num_tokens
                if seq.num_pending == 0:
                    self._fork(req)
            else:
                self.counters.output_tokens_recomputed += s.num_tokens - s.sample - len(s.draft)
        self._take_tokens(plan.targets, output, finished)
        for req, candidates in output.beams.items():
            if req.state is RequestState.FINISHED:
                continue
            self._step_beams(req, candidates)
            if req.finished:
                self._finish(req)
                finished.append(req)
        failed, self._failed = self._failed, []
        if self.line_timeout is not None:
            self._cap_started_before(self.clock() - self.line_timeout)
        if self.trace is not None:
            self.trace.append(snapshot(len(self.trace), plan, kv.pool, self.running))
            kv.pool.events.clear()
        return failed + finished

    def _take_tokens(self, targets: list[SampleTarget], output: ModelOutput, finished: list[Request]) -> None:
        """Append each target's sampled token; a target whose drafted token was drawn goes on to the
        next drafted position's row (`ModelOutput.verify`), round by round, until a token differs from
        its draft, ends the sequence, or the draft is used up (its last row's token is then a bonus)."""
        kv, sampled, depth = self.kv_cache_manager, output.sampled, 0
        while targets:
            more = []
            for i, target in enumerate(targets):
                seq, req = target.seq, target.seq.request
                if req.state is RequestState.FINISHED:
                    continue
                token = sampled.token_ids[i]
                try:
                    self._append(seq, token, sampled.logprobs[i], sampled.top[i])
                except Exception as exc:  # e.g. the tokenizer cannot decode: this request alone fails
                    self.fail(req, f"generation failed: {type(exc).__name__}: {exc}")
                    continue
                if self.speculator is not None:
                    self.speculator.stats.seq_steps += depth == 0
                    self.speculator.stats.tokens += 1
                if (draft := target.draft) is not None:
                    drafted = not seq.finished and depth < len(draft.token_ids)
                    if drafted and token == draft.token_ids[depth]:
                        more.append(replace(target, row=target.row + 1))
                        continue
                    self._settle(seq, draft, depth, mismatch=drafted)
                if seq.finished:
                    kv.free(seq)
                    if req.finished:
                        self._finish(req)
                        finished.append(req)
            depth += 1
            if more:
                sampled, failed = output.verify(more)
                for req, reason in failed.items():
                    self.fail(req, reason)
            targets = more

    def _settle(self, seq: Sequence, draft: Draft, accepted: int, mismatch: bool) -> None:
        """``seq``'s verification is over with ``accepted`` drafted tokens kept: they count as computed,
        the rejected tail's slots go (a block left empty returns to the pool), full blocks are hashed."""
        seq.num_computed += accepted
        if not seq.finished:
            self.kv_cache_manager.truncate(seq)
            self.kv_cache_manager.cache_blocks(seq)
        self.speculator.verified(seq, draft, accepted, mismatch)

    def _step_beams(self, req: Request, candidates: list[Candidate]) -> None:
        """Replace ``req``'s live beams by the candidates that run on (best first).

        A beam's first child takes the beam over; each further child forks its block table (the
        blocks are shared, the partly filled last one is copied when first written); a beam with
        no child is pruned and its blocks are freed at once.
        """
        parents = req.completions
        running = req.beam.step(candidates, [b.output_ids for b in parents])
        self.counters.generated_tokens += len(parents)
        if not running:  # the search is over: _finish frees every beam
            return
        taken = [False] * len(parents)
        children, extend = [], []
        for c in running:
            parent = parents[c.beam]
            if taken[c.beam]:
                child = Sequence(
                    req,
                    0,
                    False,
                    [*parent.token_ids, c.token],
                    req.num_prompt_tokens,
                    num_computed=parent.num_computed,
                    logits_state=None if parent.logits_state is None else parent.logits_state.fork(),
                )
                self.kv_cache_manager.fork(parent, child)
                if child.logits_state is not None:
                    child.logits_state.accept(c.token)
            else:
                taken[c.beam] = True
                child = parent
                extend.append((parent, c.token))
            child.cumulative_logprob = c.cumulative_logprob
            children.append(child)
        for parent, token in extend:  # after the forks, which copy the parents' tokens and states
            parent.token_ids.append(token)
            if parent.logits_state is not None:
                parent.logits_state.accept(token)
        for parent, kept in zip(parents, taken, strict=True):
            if not kept:
                self.kv_cache_manager.free(parent)
        for i, child in enumerate(children):
            child.index = i
        req.completions = children

    def _fork(self, req: Request) -> None:
        """The prompt is computed: each live completion gets its blocks (`KVCacheManager.fork_prompt`:
        the prompt's, shared, or a resumed completion's own cached ones), and the prompt's go."""
        parent = req.prompt_seq
        assert parent is not None and parent.num_pending == 0
        for seq in req.completions:
            if seq.finished:
                continue
            seq.num_computed = self.kv_cache_manager.fork_prompt(parent, seq)
            self.counters.output_tokens_restored += seq.num_computed - parent.num_computed
        self.kv_cache_manager.free(parent)
        req.prompt_seq = None

    def _append(
        self, seq: Sequence, token: int, logprob: float | None, top: dict | None, count: bool = True
    ) -> None:
        """Append one sampled token and decide whether it ends the sequence (and why); ``count``: it
        was generated in this run (a kept one replayed is not)."""
        p = seq.request.params
        seq.token_ids.append(token)
        if seq.logits_state is not None:
            seq.logits_state.accept(token)  # raises if its grammar refuses the token: the request fails
        if seq.logprobs is not None:
            seq.cumulative_logprob += logprob
            seq.logprobs.append(top)
        self.counters.generated_tokens += count
        if token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in self.eos_token_ids and not p.ignore_eos:
            seq.finish_reason = "stop"
        elif seq.detok is not None and (stop := seq.detok.step(token)) is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop
        elif seq.logits_state is not None and seq.logits_state.finished:  # a complete grammar
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= seq.request.max_tokens:
            seq.finish_reason, seq.capped_by = "length", seq.request.cap

    def _finish(self, req: Request) -> None:
        req.state = RequestState.FINISHED
        if self.speculator is not None:
            self.speculator.forget(req)
        for seq in [req.prompt_seq, *req.completions]:
            if seq is not None:
                self.kv_cache_manager.free(seq)
        req.prompt_seq = None
        if req in self.running:
            self.running.remove(req)

    def _cap_started_before(self, started_before: float) -> None:
        """``line_timeout``: requests admitted before ``started_before`` (preempted ones included) end
        at their next token, marked."""
        for req in (*self.running, *self.waiting):
            if req.started_s is not None and req.started_s < started_before and req.cap != "line_timeout":
                req.cap_at_next_token("line_timeout")

    # -- observation ------------------------------------------------------------------------
    def enable_trace(self) -> None:
        """Record a snapshot of the pool after every step (`core.trace`)."""
        self.trace = []
        self.kv_cache_manager.pool.events = []

    def make_stats(self) -> SchedulerStats:
        running = self.running
        return SchedulerStats(
            running_seqs=sum(r.num_future_seqs() for r in running),
            logical_blocks=sum(
                self.kv_cache_manager.num_table_blocks(s) for r in running for s in r.live_seqs()
            ),
            counters=replace(self.counters),
            kv=self.kv_cache_manager.make_stats(),
            speculation=self.speculator.make_stats() if self.speculator is not None else None,
        )

    def reset_stats(self) -> None:
        self.counters = SchedulerCounters()
        self.kv_cache_manager.reset_stats()
        if self.speculator is not None:
            self.speculator.reset_stats()

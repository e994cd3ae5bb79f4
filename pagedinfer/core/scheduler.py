"""Continuous batching, and every state change of a step: ``schedule()`` before the forward pass,
``update()`` after it (vLLM v1's ``schedule`` / ``update_from_output``).

Each step serves running requests first (decode tokens, prompt chunks, recomputation), then admits
waiting requests while the token budget, the sequence limit and the free blocks allow: in arrival
order (``fcfs``), or longest cached prefix first (``lpm``, arrival order among equals, and no request
overtaken by more than ``max_num_seqs`` later ones). An admitted prompt starts from its longest
cached prefix (prefix caching). When a running sequence needs a block and none is free, the most
recently admitted request is preempted as a whole (its blocks freed, recomputed later), never failed.

LoRA adapters (vLLM's ``max_loras``): the running requests use at most ``max_loras`` distinct
adapters, each holding a slot of the model's deltas; a waiting request whose adapter is not running
is admitted when a slot is free (its adapter is then installed there, `AdapterSlots.activate`), and
the requests behind it may go first meanwhile. Once it has been overtaken ``max_num_seqs`` times, no
request of another adapter is admitted before it, so the running adapters drain and it gets a slot:
none starves, and base-model requests (which need no slot) still pass it.

The plan names, for every sequence that receives a token this step, the logits row it samples
from; the engine only runs the model and the sampler in between. ``update`` then marks tokens
computed, forks finished prompts into their completions, appends the sampled tokens, detects stops and
frees what finished. No other module writes a sequence's state.

Prompt logprobs (``SamplingParams.prompt_logprobs``): a prompt chunk of such a request returns the
logits of every position it computes (at most `MAX_PROMPT_LOGPROB_ROWS` rows a step, so memory
stays bounded for any prompt length); ``update`` takes each position's entry for the token after it.
The entries of a full block are kept in the pool beside its hash, so a later request with the same
prefix takes them with the cached block; it then computes again only the last cached position (the
one whose logits give the first uncached token's entry).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pagedinfer.config import EngineConfig
from pagedinfer.core.beam import Candidate
from pagedinfer.core.block_pool import BlockPool, OutOfBlocks, block_hashes, chain_seed
from pagedinfer.core.sequence import Request, RequestState, Sequence
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


class AdapterSlots(Protocol):
    """The adapters' slots admission takes (`lora.registry.AdapterRegistry`)."""

    max_loras: int

    def activate(self, adapter: Any, busy: Collection[Any]) -> int:
        """The slot ``adapter`` runs in, installed now if needed (the ``busy`` adapters keep theirs);
        raises `AdapterError` when it cannot be installed."""
        ...


class Sampled(Protocol):
    """The sampler's result, one entry per target of the plan."""

    token_ids: list[int]
    logprobs: list[float | None]
    top: list[dict[int, Logprob] | None]


@dataclass
class SchedulerCounters:
    """Token and event counts since the last reset (the engine's statistics read them)."""

    prompt_tokens_computed: int = 0  # prompt tokens run through the model (recompute included)
    output_tokens_recomputed: int = 0  # generated tokens run again after a preemption
    output_tokens_restored: int = 0  # generated tokens a resumed completion found in the prefix cache
    generated_tokens: int = 0
    preemptions: int = 0
    prompt_tokens_readmitted: int = 0  # prompt tokens of requests admitted again after a preemption


MAX_MODEL_LEN_WORDS = "--max-model-len (API: max_model_len)"  # the setting, as both audiences know it


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        schedule_policy: Literal["fcfs", "lpm"] = EngineConfig.schedule_policy,
        context_set_by_option: bool = False,
        adapters: AdapterSlots | None = None,
    ) -> None:
        """``context_set_by_option``: ``max_model_len`` was set below the model's own context, so a
        too-long prompt's error names that setting (the one to raise), not the model. ``adapters``:
        the slots of the LoRA adapters requests name (None: no request names one)."""
        self.pool = pool
        self.adapters = adapters
        self.context_set_by_option = context_set_by_option
        self.schedule_policy = schedule_policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.counters = SchedulerCounters()
        self._failed: list[Request] = []  # failed since the last update(), which reports them
        self._logit_rows_left = MAX_PROMPT_LOGPROB_ROWS  # in the step being scheduled

    # -- requests -------------------------------------------------------------------------
    def rejection_reason(self, n_prompt: int, n: int, max_tokens: int, beam: bool = False) -> str | None:
        """Why a request of ``n_prompt`` tokens and ``n`` completions (or beams) can never run here, or None."""
        if n_prompt == 0:
            return "the prompt is empty"
        if n_prompt >= self.max_model_len:
            return f"the prompt has {n_prompt} tokens; {self.context_words('is')} (one more is needed to generate)"
        if n > self.max_num_seqs:
            return f"n={n} completions exceed max_num_seqs={self.max_num_seqs}"
        if beam and n > self.max_num_batched_tokens:
            return f"beam_width={n} exceeds max_num_batched_tokens={self.max_num_batched_tokens}"
        worst = self.worst_case_blocks(n_prompt, max_tokens, n)
        if worst > self.pool.num_blocks:
            return (
                f"the request may need {worst} KV blocks ({n_prompt} prompt tokens, n={n}, "
                f"max_tokens={max_tokens}, block size {self.pool.block_size}) but the pool has "
                f"{self.pool.num_blocks}; raise the pool size or lower n / max_tokens"
            )
        return None

    def context_words(self, link: str) -> str:
        """``the model's context {link} N tokens``, or ``the context {link} N tokens by --max-model-len
        (API: max_model_len)`` when that setting lowered it: the words say what to raise."""
        if self.context_set_by_option:
            return f"the context {link} {self.max_model_len} tokens by {MAX_MODEL_LEN_WORDS}"
        return f"the model's context {link} {self.max_model_len} tokens"

    def worst_case_blocks(self, n_prompt: int, max_tokens: int, n: int) -> int:
        """Blocks a request holds at its longest: shared full prompt blocks + each completion's own."""
        shared = n_prompt // self.pool.block_size
        per_completion = self.pool.blocks_for_tokens(n_prompt + max_tokens - 1) - shared
        return shared + n * per_completion

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def fail(self, req: Request, reason: str) -> None:
        """End ``req`` alone with ``reason`` (its blocks freed); the other requests go on.

        The next ``update`` returns it among the finished requests. A request fails once: a second
        reason (another of its rows failing in the same step) is dropped.
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
        for req in list(self.running):
            if req.state is not RequestState.RUNNING:
                continue  # preempted earlier in this step
            mark = (
                len(out.batch),
                len(out.copies),
                len(out.targets),
                len(out.beam_targets),
                out.num_rows,
                len(out.prompt_rows),
                self._logit_rows_left,
            )
            seqs = req.live_seqs()
            beams = req.beam is not None and req.prompt_seq is None
            together = beams and sum(s.num_pending for s in seqs) <= budget
            for seq in seqs:
                n = self._chunk(seq, budget)
                if beams and not together:  # the beams' last tokens must run in one step
                    n = min(n, seq.num_pending - 1)
                if n <= 0:
                    continue
                if not self._reserve(seq, n, req, out):  # req preempted itself: drop its share
                    del out.batch[mark[0] :], out.copies[mark[1] :], out.targets[mark[2] :]
                    del out.beam_targets[mark[3] :], out.prompt_rows[mark[5] :]
                    out.num_rows, self._logit_rows_left = mark[4], mark[6]
                    break
                self._schedule(out, seq, n)
                budget -= n
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of ``seq`` this step can compute: its pending ones within the budget (and, for a
        prompt computing its logprobs, within the step's logits rows)."""
        n = min(seq.num_pending, budget)
        if seq.is_prompt and seq.request.needs_prompt_logprobs:
            n = min(n, self._logit_rows_left)
        return n

    def _schedule(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        """Add ``n`` tokens of ``seq`` to the plan, with the targets its logits row feeds."""
        req = seq.request
        ends = seq.num_computed + n == len(seq.token_ids)
        targets = [seq] if not seq.is_prompt else [] if req.sampled_yet else req.completions
        sample = ends and bool(targets)  # a resumed request's completions recompute before they sample
        rows = int(sample)
        if seq.is_prompt and req.needs_prompt_logprobs:  # every position's logits, the last one sampled
            rows = n
            out.prompt_rows.append(PromptRows(req, out.num_rows, seq.num_computed, n))
            self._logit_rows_left -= n
        out.batch.append(ScheduledSeq(seq, seq.num_computed, n, sample, rows))
        if sample:
            dest = out.targets if req.beam is None else out.beam_targets
            dest += [SampleTarget(t, out.num_rows + rows - 1) for t in targets]
        out.num_rows += rows

    def _reserve(self, seq: Sequence, n: int, req: Request, out: SchedulerOutput) -> bool:
        """Make room for ``seq``'s next ``n`` tokens, preempting the latest admitted requests as needed.

        Returns False when ``req`` itself had to be preempted.
        """
        while True:
            try:
                copies = self.pool.reserve(seq.block_table, seq.num_computed, n)
            except OutOfBlocks:  # the pool changed nothing
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return False
                continue
            out.copies += copies
            return True

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in policy order while they fit; each starts from its cached prefix.

        A request whose next uncached prompt block is being computed right now by a request still
        in prefill waits for it (it will hit the cache instead of computing the same tokens); the
        requests behind it may go first. Its wait is bounded by that prefill.
        """
        if not self.waiting:
            return
        pool, caching = self.pool, self.pool.enable_prefix_caching
        num_seqs = sum(r.num_future_seqs() for r in self.running)
        if budget <= 0 or num_seqs >= self.max_num_seqs:
            return
        in_prefill = self._hashes_in_prefill() if caching else set()
        order = self._admission_order()
        admitted: list[int] = []  # positions in ``waiting`` of the requests admitted now
        busy = {r.lora for r in self.running if r.lora is not None}  # adapters holding a slot
        held = False  # a request waits for a slot past its bound: no other adapter goes before it
        for pos, req in order:
            if budget <= 0:
                break
            if self.running and num_seqs + req.num_future_seqs() > self.max_num_seqs:
                break
            if req.lora is not None and (held or self._waits_for_slot(req, busy)):
                held = held or req.num_overtaken >= self.max_num_seqs
                continue
            hashes = self._prompt_hashes(req) if caching else []
            if req.needs_prompt_logprobs:  # only blocks whose prompt logprobs are kept beside them
                hashes = hashes[: pool.prompt_logprobs_prefix(hashes, req.params.prompt_logprobs)]
            hits = pool.cached_prefix(hashes)
            if len(hits) < len(hashes) and hashes[len(hits)] in in_prefill:
                continue
            rewrite = req.needs_prompt_logprobs and 0 < len(hits) * pool.block_size < req.num_prompt_tokens
            copy = rewrite and pool.ref_counts[hits[-1]] > 0  # the last hit block, shared, is written
            if pool.admission_blocks(hits, req.num_prompt_tokens) + copy > pool.num_free:
                break
            if req.needs_prompt_logprobs and self._logit_rows_left <= 0:
                continue
            if req.lora is not None:
                try:
                    req.lora_slot = self.adapters.activate(req.lora, busy)
                except AdapterError as e:
                    self.fail(req, f"lora: {e}")
                    continue
                busy.add(req.lora)
            self.waiting.remove(req)
            admitted.append(pos)
            req.state = RequestState.RUNNING
            self.running.append(req)
            num_seqs += req.num_future_seqs()
            if req.num_preemptions:
                self.counters.prompt_tokens_readmitted += req.num_prompt_tokens
            if not req.completions:  # a beam search starts from one beam
                n = 1 if req.beam is not None else req.params.n
                req.completions = [self._new_completion(req, i) for i in range(n)]
            seq = Sequence(req, 0, True, list(req.prompt_token_ids), req.num_prompt_tokens)
            req.prompt_seq = seq
            seq.block_table = pool.match_prefix(seq.token_ids, hashes)
            seq.num_computed = min(len(seq.block_table) * pool.block_size, req.num_prompt_tokens - 1)
            if req.needs_prompt_logprobs:
                self._take_prompt_logprobs(req, hashes[: len(seq.block_table)])
                if rewrite:  # the last cached position's logits give the first uncached token's entry
                    seq.num_computed -= 1
            n = self._chunk(seq, budget)
            out.copies += pool.reserve(seq.block_table, seq.num_computed, n)
            self._schedule(out, seq, n)
            budget -= n
            in_prefill.update(hashes)
        if admitted:
            admitted.sort()
            for pos, req in order:
                if req.state is RequestState.WAITING:  # passed over by every later arrival admitted now
                    req.num_overtaken += len(admitted) - bisect_right(admitted, pos)

    def _waits_for_slot(self, req: Request, busy: set) -> bool:
        """Whether ``req``'s adapter is not running and every slot is held by a running adapter."""
        return req.lora not in busy and len(busy) >= self.adapters.max_loras

    def _take_prompt_logprobs(self, req: Request, hashes: list[bytes]) -> None:
        """Fill ``req``'s prompt logprobs from the entries kept beside its cached blocks."""
        bs, k = self.pool.block_size, req.params.prompt_logprobs
        for b, digest in enumerate(hashes):
            for j, entry in enumerate(self.pool.kept_prompt_logprobs[digest][1]):
                pos = b * bs + j
                if entry is not None and req.prompt_logprobs[pos] is None:  # kept with k or more: cut to k
                    token = req.prompt_token_ids[pos]
                    req.prompt_logprobs[pos] = {
                        t: lp for t, lp in entry.items() if lp.rank <= k or t == token
                    }
        req.prompt_logprobs_upto = max(req.prompt_logprobs_upto, len(hashes) * bs)

    def _keep_prompt_logprobs(self, seq: Sequence, start: int, end: int) -> None:
        """Keep the entries of the blocks of ``seq`` completed by computing positions [start, end)."""
        req, pool, bs = seq.request, self.pool, self.pool.block_size
        k = req.params.prompt_logprobs
        for b in range(start // bs, min(end, req.prompt_logprobs_upto) // bs):
            digest = pool.hashes[seq.block_table[b]] if b < len(seq.block_table) else None
            if digest is not None:
                pool.keep_prompt_logprobs(digest, k, req.prompt_logprobs[b * bs : (b + 1) * bs])

    def _admission_order(self) -> list[tuple[int, Request]]:
        """Waiting requests with their queue positions, in the order admission considers them.

        ``lpm`` (longest prefix match, SGLang's name): most cached prompt blocks first, queue order
        among equals, so that requests sharing a cached prefix run while it is still cached instead
        of after it was evicted. A request overtaken ``max_num_seqs`` times goes first: none starves.
        """
        waiting = list(enumerate(self.waiting))
        if self.schedule_policy == "fcfs" or not self.pool.enable_prefix_caching or len(waiting) < 2:
            return waiting

        def key(item: tuple[int, Request]) -> tuple[bool, int, int]:
            pos, req = item
            if req.num_overtaken >= self.max_num_seqs:
                return (False, 0, pos)
            return (True, -len(self.pool.cached_prefix(self._prompt_hashes(req))), pos)

        return sorted(waiting, key=key)

    def _prompt_hashes(self, req: Request) -> list[bytes]:
        if req.prompt_hashes is None:
            req.prompt_hashes = block_hashes(
                req.prompt_token_ids, self.pool.block_size, chain_seed(req.adapter_digest)
            )
        return req.prompt_hashes

    def _hashes_in_prefill(self) -> set[bytes]:
        """Full prompt blocks that running requests are computing (or have computed) now."""
        return {h for r in self.running if r.prompt_seq is not None for h in self._prompt_hashes(r)}

    @staticmethod
    def _new_completion(req: Request, index: int) -> Sequence:
        generator, detok, state = req.completion_state(index) if req.completion_state else (None, None, None)
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

    def _preempt(self, req: Request) -> None:
        """Free every block of ``req`` and queue it first; its tokens are recomputed on return."""
        for seq in [req.prompt_seq, *req.completions]:
            if seq is not None:
                self.pool.free(seq.block_table)
                seq.num_computed = 0
        req.prompt_seq = None
        req.state = RequestState.WAITING
        req.num_preemptions += 1
        self.counters.preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    # -- after the forward pass -----------------------------------------------------------
    def update(
        self,
        plan: SchedulerOutput,
        sampled: Sampled | None,
        beams: dict[Request, list[Candidate]] | None = None,
        prompt_logprobs: list[list[dict[int, Logprob]]] | None = None,
    ) -> list[Request]:
        """Apply one step's result; return the requests that finished in it (failed ones included).

        ``beams``: each beam search's candidates of this step (from its live beams' logits rows).
        ``prompt_logprobs``: per entry of ``plan.prompt_rows``, the entries of the prompt tokens after
        its positions (the prompt's last position gives none).
        """
        finished: list[Request] = []
        for chunk, entries in zip(plan.prompt_rows, prompt_logprobs or [], strict=False):
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
            seq.num_computed += s.num_tokens
            self.pool.register_full_blocks(
                seq.block_table, seq.token_ids, seq.num_computed, chain_seed(req.adapter_digest)
            )
            if seq.is_prompt and req.params.prompt_logprobs is not None and self.pool.enable_prefix_caching:
                self._keep_prompt_logprobs(seq, s.start, seq.num_computed)
            if seq.is_prompt:
                self.counters.prompt_tokens_computed += s.num_tokens
                if seq.num_pending == 0:
                    self._fork(req)
            else:
                self.counters.output_tokens_recomputed += s.num_tokens - s.sample
        for i, target in enumerate(plan.targets):
            seq, req = target.seq, target.seq.request
            if req.state is RequestState.FINISHED:
                continue
            try:
                self._append(seq, sampled.token_ids[i], sampled.logprobs[i], sampled.top[i])
            except Exception as exc:  # e.g. the tokenizer cannot decode: this request alone fails
                self.fail(req, f"generation failed: {type(exc).__name__}: {exc}")
                continue
            if seq.finished:
                self.pool.free(seq.block_table)
                if req.finished:
                    self._finish(req)
                    finished.append(req)
        for req, candidates in (beams or {}).items():
            if req.state is RequestState.FINISHED:
                continue
            self._step_beams(req, candidates)
            if req.finished:
                self._finish(req)
                finished.append(req)
        failed, self._failed = self._failed, []
        return failed + finished

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
                    block_table=self.pool.fork(parent.block_table),
                    num_computed=parent.num_computed,
                    logits_state=None if parent.logits_state is None else parent.logits_state.fork(),
                )
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
                self.pool.free(parent.block_table)
        for i, child in enumerate(children):
            child.index = i
        req.completions = children

    def _fork(self, req: Request) -> None:
        """The prompt is computed: every live completion takes a reference to its blocks (no copy).

        A completion resumed after a preemption starts from its own longest cached prefix instead, when
        that reaches past the prompt's full blocks: the full blocks of its generated tokens were
        cached before the preemption and, unless evicted since, are not computed again.
        """
        parent, pool = req.prompt_seq, self.pool
        assert parent is not None and parent.num_pending == 0
        prompt_blocks = req.num_prompt_tokens // pool.block_size
        for seq in req.completions:
            if seq.finished:
                continue
            seed = chain_seed(req.adapter_digest)
            hashes = block_hashes(seq.token_ids, pool.block_size, seed) if seq.num_output_tokens else []
            if len(pool.cached_prefix(hashes)) > prompt_blocks:
                seq.block_table = pool.match_prefix(seq.token_ids, hashes, prompt=False)
                seq.num_computed = min(len(seq.block_table) * pool.block_size, len(seq.token_ids) - 1)
                self.counters.output_tokens_restored += seq.num_computed - parent.num_computed
            else:
                seq.block_table = pool.fork(parent.block_table)
                seq.num_computed = parent.num_computed
        pool.free(parent.block_table)
        req.prompt_seq = None

    def _append(self, seq: Sequence, token: int, logprob: float | None, top: dict | None) -> None:
        """Append one sampled token and decide whether it ends the sequence (and why)."""
        p = seq.request.params
        seq.token_ids.append(token)
        if seq.logits_state is not None:
            seq.logits_state.accept(token)  # raises if its grammar refuses the token: the request fails
        if seq.logprobs is not None:
            seq.cumulative_logprob += logprob
            seq.logprobs.append(top)
        self.counters.generated_tokens += 1
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
        for seq in [req.prompt_seq, *req.completions]:
            if seq is not None:
                self.pool.free(seq.block_table)
        req.prompt_seq = None
        if req in self.running:
            self.running.remove(req)

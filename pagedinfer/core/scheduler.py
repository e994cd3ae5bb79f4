"""Continuous batching: which sequences run this step, how many tokens each, and who is preempted.

Each step serves running requests first (decode tokens, prompt chunks, recomputation), then admits
waiting requests in arrival order while the token budget, the sequence limit and the free blocks
allow; an admitted prompt starts from its longest cached prefix (prefix caching). When a running sequence needs a block and none is free, the most recently admitted request
is preempted as a whole (its blocks freed, recomputed later), never failed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedinfer.core.beam import Candidate
from pagedinfer.core.block_pool import BlockPool, OutOfBlocks, block_hashes
from pagedinfer.core.sequence import Request, RequestState, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (= tokens already in the pool)
    num_tokens: int
    sample: bool  # the chunk ends the sequence's pending tokens and a next token is drawn


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class Scheduler:
    def __init__(
        self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
    ) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self.num_prompt_tokens_readmitted = 0  # prompt tokens of requests admitted again after preemption

    def check(self, n_prompt: int, n: int, max_tokens: int) -> str | None:
        """Why a request of ``n_prompt`` tokens and ``n`` samples can never run here, or None."""
        if n_prompt == 0:
            return "the prompt is empty"
        if n_prompt >= self.max_model_len:
            return (
                f"the prompt has {n_prompt} tokens; the model's context is {self.max_model_len} tokens "
                "(one more is needed to generate)"
            )
        if n > self.max_num_seqs:
            return f"n={n} samples exceed max_num_seqs={self.max_num_seqs}"
        worst = self.worst_case_blocks(n_prompt, max_tokens, n)
        if worst > self.pool.num_blocks:
            return (
                f"the request may need {worst} KV blocks ({n_prompt} prompt tokens, n={n}, "
                f"max_tokens={max_tokens}, block size {self.pool.block_size}) but the pool has "
                f"{self.pool.num_blocks}; raise the pool size or lower n / max_tokens"
            )
        return None

    def worst_case_blocks(self, n_prompt: int, max_tokens: int, n: int) -> int:
        """Blocks a request holds at its longest: shared full prompt blocks + each sample's own."""
        bs = self.pool.block_size
        shared = n_prompt // bs
        per_sample = self.pool.blocks_for_tokens(n_prompt + max_tokens - 1) - shared
        return shared + n * per_sample

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for req in list(self.running):
            if req.state is not RequestState.RUNNING:
                continue  # preempted earlier in this step
            mark = (len(out.seqs), len(out.copies))
            for seq in req.live_seqs():
                if budget == 0:
                    break
                if seq.num_pending == 0:
                    continue  # a beam waiting for its siblings' logits
                n = min(seq.num_pending, budget)
                if not self._write(seq, n, req, out):
                    del out.seqs[mark[0] :], out.copies[mark[1] :]
                    break
                out.seqs.append(ScheduledSeq(seq, seq.num_computed, n, self._samples(seq, n)))
                budget -= n
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _samples(self, seq: Sequence, n: int) -> bool:
        if seq.num_computed + n < len(seq.token_ids):
            return False
        return seq.index >= 0 or not seq.request.samples  # a resumed request's samples have tokens

    def _write(self, seq: Sequence, n: int, req: Request, out: SchedulerOutput) -> bool:
        """Make room for ``seq``'s next ``n`` tokens, preempting the latest admitted requests as needed.

        Returns False when ``req`` itself had to be preempted.
        """
        while True:
            try:
                copies = self.pool.write(seq.block_table, seq.num_computed, n)
            except OutOfBlocks:  # the pool changed nothing
                victim = self.running[-1]
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return False
                continue
            out.copies += copies
            return True

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in arrival order while they fit; each starts from its cached prefix.

        A request whose next uncached prompt block is being computed right now by a request still
        in prefill waits for it (it will hit the cache instead of computing the same tokens);
        the requests behind it may go first. Its wait is bounded by that prefill.
        """
        if not self.waiting:
            return
        pool, caching = self.pool, self.pool.enable_prefix_caching
        num_seqs = sum(r.num_future_seqs() for r in self.running)
        in_prefill = self._hashes_in_prefill() if caching else set()
        for req in list(self.waiting):
            if budget <= 0:
                break
            if self.running and num_seqs + req.num_future_seqs() > self.max_num_seqs:
                break
            hashes = self._prompt_hashes(req) if caching else []
            hits = pool.cached_prefix(hashes)
            if len(hits) < len(hashes) and hashes[len(hits)] in in_prefill:
                continue
            if pool.admission_blocks(hits, req.num_prompt_tokens) > pool.num_free:
                break
            self.waiting.remove(req)
            req.state = RequestState.RUNNING
            self.running.append(req)
            num_seqs += req.num_future_seqs()
            if req.num_preemptions:
                self.num_prompt_tokens_readmitted += req.num_prompt_tokens
            seq = Sequence(req, -1, list(req.prompt_token_ids), req.num_prompt_tokens)
            req.prompt_seq = seq
            seq.block_table = pool.match_prefix(seq.token_ids, hashes)
            seq.num_computed = min(len(seq.block_table) * pool.block_size, req.num_prompt_tokens - 1)
            n = min(seq.num_pending, budget)
            out.copies += pool.write(seq.block_table, seq.num_computed, n)
            out.seqs.append(ScheduledSeq(seq, seq.num_computed, n, self._samples(seq, n)))
            budget -= n
            in_prefill.update(hashes)

    def _prompt_hashes(self, req: Request) -> list[bytes]:
        if req.prompt_hashes is None:
            req.prompt_hashes = block_hashes(req.prompt_token_ids, self.pool.block_size)
        return req.prompt_hashes

    def _hashes_in_prefill(self) -> set[bytes]:
        """Full prompt blocks that running requests are computing (or have computed) now."""
        return {h for r in self.running if r.prompt_seq is not None for h in self._prompt_hashes(r)}

    def register(self, seq: Sequence) -> None:
        """Offer ``seq``'s newly full, computed blocks to the prefix cache (after each step)."""
        self.pool.register_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)

    def preempt(self, req: Request) -> None:
        """Free every block of ``req`` and queue it first; its tokens are recomputed on return."""
        for seq in [req.prompt_seq, *req.samples]:
            if seq is not None:
                self.pool.free(seq.block_table)
                seq.num_computed = 0
                seq.beam_logits = None
        req.prompt_seq = None
        req.state = RequestState.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def fork(self, req: Request) -> None:
        """The prompt is computed: every live sample takes a reference to its blocks (no copy)."""
        parent = req.prompt_seq
        assert parent is not None and parent.num_pending == 0
        for seq in req.samples:
            if not seq.finished:
                seq.block_table = self.pool.fork(parent.block_table)
                seq.num_computed = parent.num_computed
        self.pool.free(parent.block_table)
        req.prompt_seq = None

    def advance_beams(self, req: Request, running: list[Candidate]) -> None:
        """Replace ``req``'s live beams by the candidates that run on (best first).

        A beam's first child takes the beam over; each further child forks its block table (the
        blocks are shared, the partly filled last one is copied when first written); a beam with
        no child is pruned and its blocks are freed at once.
        """
        parents = req.samples
        taken = [False] * len(parents)
        beams, extend = [], []
        for c in running:
            parent = parents[c.beam]
            if taken[c.beam]:
                child = Sequence(
                    req,
                    0,
                    [*parent.token_ids, c.token],
                    req.num_prompt_tokens,
                    block_table=self.pool.fork(parent.block_table),
                    num_computed=parent.num_computed,
                )
            else:
                taken[c.beam] = True
                child = parent
                extend.append((parent, c.token))
            child.cumulative_logprob = c.cumulative_logprob
            child.beam_logits = None
            beams.append(child)
        for parent, token in extend:  # after the forks, which copy the parents' tokens
            parent.token_ids.append(token)
        for parent, kept in zip(parents, taken, strict=True):
            if not kept:
                self.pool.free(parent.block_table)
        for i, beam in enumerate(beams):
            beam.index = i
        req.samples = beams

    def finish_seq(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)

    def finish_request(self, req: Request) -> None:
        req.state = RequestState.FINISHED
        for seq in [req.prompt_seq, *req.samples]:
            if seq is not None:
                self.pool.free(seq.block_table)
        req.prompt_seq = None
        if req in self.running:
            self.running.remove(req)

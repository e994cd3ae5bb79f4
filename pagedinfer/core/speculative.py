"""Drafts with no second model, and whether they pay: the proposing half of speculative decoding.

A decoding sequence may run, after its own pending token, a few drafted tokens in the same step; the
scheduler verifies them (each drafted position's token drawn exactly as without speculation) and
keeps them up to the first mismatch. This module only proposes:

* ``prompt_lookup``: the sequence's last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens (the
  longest that matches first) looked up earlier in its own prompt and output; the tokens that followed
  their latest occurrence are the draft (vLLM's ``ngram`` method, llama.cpp's lookup decoding);
* ``siblings``: the same suffix looked up in the outputs of the request's other completions (n > 1).

The n-grams are indexed as tokens arrive (a dict per n-gram size range: the prompt's once per request,
each completion's outputs on its own), so a proposal costs a few dict lookups, not a scan.

Gating: a drafted row costs the step ``per_row`` more; an accepted draft token saves the sequence's
share of a step. With a step of R rows costing ``fixed + per_row * R`` (`RowCost`, measured by the
engine at start-up) and B sequences decoding, the k-th draft token is worth its row when the chance
it is accepted, ``rate ** k``, is at least ``per_row * B / (fixed + per_row * B)``. ``rate`` is each
line's acceptance rate for the source, from decayed counts (so a line whose drafts stopped matching
stops drafting, and one gated off drifts back to the prior and tries again where rows are cheap).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedinfer.config import SpeculativeConfig

if TYPE_CHECKING:
    from pagedinfer.core.sequence import Request, Sequence

SOURCES = ("prompt_lookup", "siblings")
PRIOR_HITS, PRIOR_MISSES = 1.0, 1.0  # a line's first drafts: acceptance rate 1/2 assumed
DECAY = 0.8  # weight of a line's earlier outcomes at each new one (recent outcomes count most)


class NgramIndex:
    """Where each n-gram (n in ``[lo, hi]``) of a growing token list last occurred with a token after it:
    n-gram -> the position of that following token. Positions below ``first`` are left out (another
    index holds them)."""

    def __init__(self, lo: int, hi: int, first: int = 0) -> None:
        self.lo, self.hi = lo, hi
        self.at: dict[tuple[int, ...], int] = {}
        self.upto = max(first, 1)  # the next position whose preceding n-grams are indexed

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams followed by ``tokens[self.upto:]`` (the tokens appended since the last call)."""
        at, lo = self.at, self.lo
        for p in range(self.upto, len(tokens)):
            for n in range(lo, min(self.hi, p) + 1):
                at[tuple(tokens[p - n : p])] = p
        self.upto = max(self.upto, len(tokens))


@dataclass
class Acceptance:
    """One line's drafts from one source: decayed counts of accepted tokens and of mismatches."""

    hits: float = PRIOR_HITS
    misses: float = PRIOR_MISSES

    @property
    def rate(self) -> float:
        """The chance the next drafted token is accepted, given the previous one was."""
        return self.hits / (self.hits + self.misses)

    def record(self, accepted: int, mismatch: bool) -> None:
        self.hits = self.hits * DECAY + accepted
        self.misses = self.misses * DECAY + mismatch

    def relax(self) -> None:
        """A step the line could have drafted but was gated off: drift back toward the prior."""
        self.hits = self.hits * DECAY + PRIOR_HITS * (1 - DECAY)
        self.misses = self.misses * DECAY + PRIOR_MISSES * (1 - DECAY)


@dataclass(frozen=True)
class RowCost:
    """A step of R rows costs ``fixed + per_row * R`` (the engine's start-up measurement): only their
    ratio matters. ``fixed_over_row`` infinite: rows are free, every draft is taken (tests)."""

    fixed_over_row: float

    def threshold(self, num_seqs: int) -> float:
        """The acceptance chance a drafted row must have to pay, in a step of ``num_seqs`` sequences."""
        return num_seqs / (self.fixed_over_row + num_seqs)


@dataclass
class Draft:
    source: str
    token_ids: list[int]


@dataclass
class SourceCounts:
    """Drafted and accepted tokens of one source since the last reset."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # sequence-steps that verified a draft from it


@dataclass
class SpeculationStats:
    """The speculator's counts since the last `Speculator.reset_stats`."""

    num_speculative_tokens: int = 0
    fixed_over_row: float = 0.0
    sources: dict[str, SourceCounts] = field(default_factory=lambda: {s: SourceCounts() for s in SOURCES})
    gated: int = 0  # sequence-steps with a match whose draft the gate refused
    seq_steps: int = 0  # sequence-steps that took tokens (drafting or not)
    tokens: int = 0  # tokens they took


class Speculator:
    """Proposes each decoding sequence's draft, and learns from each verification's outcome."""

    def __init__(self, config: SpeculativeConfig, cost: RowCost) -> None:
        self.config = config
        self.cost = cost
        self._prompts: dict[Request, NgramIndex] = {}
        self._outputs: dict[Sequence, NgramIndex] = {}
        self._acceptance: dict[tuple[Request, str], Acceptance] = {}
        self.stats = SpeculationStats(config.num_speculative_tokens, cost.fixed_over_row)

    def _index(self, seq: Sequence) -> NgramIndex:
        """``seq``'s index of n-grams followed by its generated tokens, brought up to date."""
        c = self.config
        index = self._outputs.get(seq)
        if index is None:
            index = self._outputs[seq] = NgramIndex(
                c.prompt_lookup_min, c.prompt_lookup_max, seq.num_prompt_tokens
            )
        index.extend(seq.token_ids)
        return index

    def _prompt_index(self, req: Request) -> NgramIndex:
        index = self._prompts.get(req)
        if index is None:
            c = self.config
            index = self._prompts[req] = NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max)
            index.extend(req.prompt_token_ids)
        return index

    def _lookup(self, seq: Sequence, room: int) -> Draft | None:
        """The longest suffix of ``seq`` found earlier (own output, prompt, then siblings' outputs) and
        up to ``room`` tokens that followed it."""
        tokens, req = seq.token_ids, seq.request
        siblings = [s for s in req.completions if s is not seq and s.num_output_tokens]
        own, prompt = self._index(seq), self._prompt_index(req)
        others = [(s, self._index(s)) for s in siblings]
        for n in range(
            min(self.config.prompt_lookup_max, len(tokens)), self.config.prompt_lookup_min - 1, -1
        ):
            key = tuple(tokens[-n:])
            at = own.at.get(key)
            if at is None:
                at = prompt.at.get(key)
            if at is not None:
                return Draft("prompt_lookup", tokens[at : at + room])
            for sib, index in others:
                if (at := index.at.get(key)) is not None:
                    return Draft("siblings", sib.token_ids[at : at + room])
        return None

    def propose(self, seq: Sequence, room: int, num_seqs: int) -> Draft | None:
        """A draft of at most ``room`` tokens for ``seq`` (decoding: one token pending) in a step of
        ``num_seqs`` sequences, or None (no match, or the gate finds it would not pay)."""
        room = min(room, self.config.num_speculative_tokens)
        if room <= 0:
            return None
        draft = self._lookup(seq, room)
        if draft is None or not draft.token_ids:
            return None
        acceptance = self._acceptance.setdefault((seq.request, draft.source), Acceptance())
        threshold, rate = self.cost.threshold(num_seqs), acceptance.rate
        k, chance = 0, rate
        while k < len(draft.token_ids) and chance >= threshold:  # the (k+1)-th token pays for its row
            k, chance = k + 1, chance * rate
        if k == 0:
            acceptance.relax()
            self.stats.gated += 1
            return None
        draft.token_ids = draft.token_ids[:k]
        return draft

    def verified(self, seq: Sequence, draft: Draft, accepted: int, mismatch: bool) -> None:
        """The outcome of ``draft``: its first ``accepted`` tokens kept; ``mismatch``: a drawn token
        differed (not an end of the sequence inside the draft)."""
        self._acceptance.setdefault((seq.request, draft.source), Acceptance()).record(accepted, mismatch)
        counts = self.stats.sources[draft.source]
        counts.drafted += len(draft.token_ids)
        counts.accepted += accepted
        counts.steps += 1

    def forget(self, req: Request) -> None:
        """``req`` finished: drop its indexes and acceptance counts."""
        self._prompts.pop(req, None)
        for seq in [req.prompt_seq, *req.completions]:
            self._outputs.pop(seq, None)
        for source in SOURCES:
            self._acceptance.pop((req, source), None)

    def make_stats(self) -> SpeculationStats:
        s = self.stats
        return SpeculationStats(
            s.num_speculative_tokens,
            s.fixed_over_row,
            {name: SourceCounts(c.drafted, c.accepted, c.steps) for name, c in s.sources.items()},
            s.gated,
            s.seq_steps,
            s.tokens,
        )

    def reset_stats(self) -> None:
        self.stats = SpeculationStats(self.config.num_speculative_tokens, self.cost.fixed_over_row)

"""Drafts with no second model, and whether they pay: the proposing half of speculative decoding.

A decoding sequence may run, after its own pending token, a few drafted tokens in the same step; the
scheduler verifies them (each drafted position's token drawn exactly as without speculation) and
keeps them up to the first mismatch. Any source is therefore exact by construction; this module only
proposes, from (first that has a draft):

* ``grammar``: the tokens a structured output's grammar forces next (its fixed keys and punctuation);
* ``prompt_lookup``: the sequence's last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens (the
  longest that matches first) looked up earlier in its own prompt and output; the tokens that followed
  their latest occurrence are the draft (vLLM's ``ngram`` method, llama.cpp's lookup decoding);
* ``siblings``: the same suffix looked up in the outputs of the request's other completions (n > 1);
* ``finished``: the same suffix looked up in the lines finished earlier in the run (`FinishedLines`,
  the last ``suffix_decoding_max_cached_requests`` completions, each its prompt's tail and output);
* ``draft_model`` (method ``draft_model``, in place of the three lookups): a small second model's
  greedy tokens (a `Drafter`: `engine.draft_model`), made once the gate has said how many to make.

The n-grams are indexed as tokens arrive (a dict per n-gram size range: the prompt's once per request,
each completion's outputs on its own, a finished completion's once), so a proposal costs a few dict
lookups, not a scan. A request's completions share one index of their outputs (`RequestLines`: per
n-gram, the completions holding it), so the siblings' match is two dict reads, not one read of each
of the n - 1 siblings' indexes (at n = 64 that scan was most of the proposals' cost).

Gating (`draft_length`): with B sequences decoding, a step of B rows gives B tokens; drafting k more
rows for one of them makes the step cost ``seconds(B + k)`` and gives ``B + rate + ... + rate ** k``
tokens expected, so the draft is cut to the k that gives the most tokens a second, none when no k
beats the step without it. ``rate`` is each line's acceptance rate for the source, from decayed counts
(so a line whose drafts stopped matching stops drafting, and one gated off drifts back to the prior
and tries again where rows are cheap). ``seconds(R)`` is the run's own: `StepTimes` keeps the recent
wall times of its decode steps by row count (seeded by a start-up measurement) and reads a count's
cost off their medians, so whatever a row more costs on the path the step takes (the one-call C step
up to `MAX_QUERY_ROWS` rows a sequence, layer by layer past it), sampling and verification are in it;
a fixed `RowCost` line stands in for it in tests.

Probes: one refused draft in `EXPLORE_EVERY` still runs its first token, so that the row counts the
gate refuses keep being timed (it must go on learning what rows cost, or a curve measured once on a
loaded machine would close the gate for good). Only a draft that would pay were its rows free is
probed (`could_pay`): where it would not, no row cost can change the verdict, and a probe's row buys
a time the gate never needs. That is the draft at a big batch (at 64 sequences a draft of 5 tokens,
all kept, adds under the `MARGIN` the bar asks) and the draft of a line whose rate is low; such a
draft is refused before it is priced. So probing stops where nothing can be gained, and goes on
wherever the curve decides (small batches, lines whose drafts are kept).

A draft model's draft costs more than its rows in the target's step: the draft model's own passes,
one per drafted token, each over the rows of every line drafting at that depth, the first also
computing the positions whose draft K/V its blocks lack (the tokens since its last draft). The gate prices them
too (`Speculator._draft_model_cost`): the seconds of a pass of R rows are read off the draft model's
own pass times (a `StepTimes`, seeded at start-up, refit from its passes), the marginal seconds a
line's passes add to the step's planned passes join the step's cost, and a line that has not drafted
for a while (its whole prompt, the first time) has its catch-up priced as shared by the drafts it
makes it possible, spread over the steps its remaining tokens would take at the draft's rate. A line
gated off computes nothing in the draft model: it catches up lazily, in the first pass of its next
draft, prefill-style (one multi-row chunk).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median
from time import perf_counter
from typing import TYPE_CHECKING, Protocol

from pagedinfer.config import SpeculativeConfig

if TYPE_CHECKING:
    from pagedinfer.core.scheduler import ScheduledSeq
    from pagedinfer.core.sequence import Request, Sequence

SOURCES = ("grammar", "prompt_lookup", "siblings", "finished", "draft_model")
PRIOR_WEIGHT = 2.0  # outcomes a line's prior counts for (its source's rate in the run, 1/2 at first)
# a source's rate before its first outcome in the run, where not 1/2: a draft model is chosen to agree
# with its target, and (its probes paying the line's catch-up, none are made) a line it would not try
# at 1/2 would never show what it agrees on; the run's outcomes correct the guess within a few drafts
FIRST_RATE = {"draft_model": 0.9}
DECAY = 0.8  # weight of a line's earlier outcomes at each new one (recent outcomes count most)
LINE_TOKENS = 2048  # a finished completion's tokens indexed at most (its prompt's tail, then output)
WINDOW = 15  # the latest step times kept per row count: their median is that count's cost
MIN_TIMES = 3  # a row count's times needed before it counts in the fit
FIT_EVERY = 8  # times added between refits of the step costs (`StepTimes.add`)
EXPLORE_EVERY = 16  # a gated-off draft in this many still runs one token: the times of more rows
MARGIN = 0.1  # a draft must promise this much more tokens a second: smaller gains are within the
# step costs' error, and a wrong draft costs more than a missed one gains


class Drafter(Protocol):
    """A second model proposing drafts (`engine.draft_model.DraftModel`)."""

    times: StepTimes  # its passes' wall times by row count

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """For each ``(seq, k)``, up to ``k`` tokens to follow ``seq``'s tokens."""

    def gap(self, seq: Sequence) -> int:
        """The positions of ``seq`` its next draft computes before its first drafted token."""

    def make_stats(self) -> object: ...

    def reset_stats(self) -> None: ...


class NgramIndex:
    """Where each n-gram (n in ``[lo, hi]``) of a growing token list last occurred with a token after it:
    n-gram -> the position of that following token. Positions below ``first`` are left out (another
    index holds them)."""

    def __init__(self, lo: int, hi: int, first: int = 0) -> None:
        self.lo, self.hi = lo, hi
        self.at: dict[tuple[int, ...], int] = {}
        self.upto = max(first, 1)  # the next position whose preceding n-grams are indexed

    def extend(self, tokens: list[int]) -> list[tuple[int, ...]]:
        """Index the n-grams followed by ``tokens[self.upto:]`` (the tokens appended since the last
        call); the n-grams it did not hold before."""
        at, lo, new = self.at, self.lo, []
        for p in range(self.upto, len(tokens)):
            for n in range(lo, min(self.hi, p) + 1):
                gram = tuple(tokens[p - n : p])
                if gram not in at:
                    new.append(gram)
                at[gram] = p
        self.upto = max(self.upto, len(tokens))
        return new


class RequestLines:
    """One request's n-grams for its completions' lookups: its prompt's (`NgramIndex`, once), each
    completion's output's (an `NgramIndex` from its first generated token on), and per n-gram the
    completions whose outputs hold it, in completions order. So a completion's own match is one dict
    read and its siblings' match (the first other completion, in completions order, holding the
    n-gram: what a scan of the siblings' indexes would find) is two, whatever n is; the scan made each
    of n completions read n - 1 indexes every step.

    `sync` brings it up to the completions' tokens: the n-grams each completion's new tokens follow,
    and a completion whose tokens were cut back (fewer than it has indexed) indexed again from its
    prompt, so the index is always that of the tokens synced (the engine's lines only grow: a draft's
    tokens are appended once verified, never before)."""

    def __init__(self, req: Request, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.prompt = NgramIndex(lo, hi)
        self.prompt.extend(req.prompt_token_ids)
        self.seqs: list[Sequence] = []  # the completions, in order (a completion's place)
        self.slots: dict[Sequence, int] = {}  # completion -> its place
        self.lines: list[NgramIndex] = []  # by place: each completion's output n-grams
        self.holders: dict[tuple[int, ...], list[int]] = {}  # n-gram -> places holding it, ascending
        self.synced = -1  # the step it was last synced in (`Speculator._lookup`)

    def sync(self, completions: list[Sequence]) -> None:
        shared = len(completions) > 1  # a lone completion has no siblings: no holders kept
        for place, seq in enumerate(completions):
            if place == len(self.lines):
                self.seqs.append(seq)
                self.slots[seq] = place
                self.lines.append(NgramIndex(self.lo, self.hi, seq.num_prompt_tokens))
            line, tokens = self.lines[place], seq.token_ids
            if len(tokens) < line.upto:  # cut back: its n-grams dropped, its tokens indexed again
                for gram in line.at if shared else ():
                    holders = self.holders[gram]
                    holders.remove(place)
                    if not holders:
                        del self.holders[gram]
                line = self.lines[place] = NgramIndex(self.lo, self.hi, seq.num_prompt_tokens)
            new = line.extend(tokens)
            for gram in new if shared else ():
                insort(self.holders.setdefault(gram, []), place)

    def sibling(self, seq: Sequence, gram: tuple[int, ...]) -> tuple[Sequence, int] | None:
        """The first completion other than ``seq`` (in completions order) whose output holds ``gram``,
        and the position of the token that followed its latest occurrence there; None if none does."""
        holders = self.holders.get(gram)
        if holders is None:
            return None
        place = holders[0]
        if place == self.slots[seq]:
            if len(holders) == 1:
                return None
            place = holders[1]
        return self.seqs[place], self.lines[place].at[gram]


class FinishedLines:
    """The n-grams of the last ``capacity`` finished completions, oldest dropped first: n-gram -> the
    latest line holding it, whose tokens after it are a draft for another line. Memory is bounded by
    ``capacity`` lines of at most `LINE_TOKENS` tokens, each indexed for ``hi - lo + 1`` sizes."""

    def __init__(self, lo: int, hi: int, capacity: int) -> None:
        self.lo, self.hi, self.capacity = lo, hi, capacity
        self.lines: OrderedDict[int, tuple[list[int], NgramIndex]] = OrderedDict()  # oldest first
        self.latest: dict[tuple[int, ...], int] = {}
        self._next = 0

    def add(self, tokens: list[int]) -> None:
        """Index a finished completion's ``tokens``; past ``capacity`` lines, drop the oldest (and each
        n-gram whose latest line it was: no other line held it since)."""
        tokens = tokens[:LINE_TOKENS]
        if self.capacity == 0 or len(tokens) <= self.lo:
            return
        index = NgramIndex(self.lo, self.hi)
        index.extend(tokens)
        line, self._next = self._next, self._next + 1
        self.lines[line] = (tokens, index)
        for gram in index.at:
            self.latest[gram] = line
        while len(self.lines) > self.capacity:
            old, (_, old_index) = self.lines.popitem(last=False)
            for gram in old_index.at:
                if self.latest.get(gram) == old:
                    del self.latest[gram]

    def follow(self, gram: tuple[int, ...], room: int) -> list[int] | None:
        """Up to ``room`` tokens that followed ``gram`` in the latest line holding it, or None."""
        line = self.latest.get(gram)
        if line is None:
            return None
        tokens, index = self.lines[line]
        at = index.at[gram]
        return tokens[at : at + room]


@dataclass
class Acceptance:
    """One line's drafts from one source: decayed counts of accepted tokens and of mismatches, from a
    prior rate (the source's rate over the run's earlier drafts: a new line starts where others are)."""

    prior: float = 0.5
    hits: float = field(init=False)
    misses: float = field(init=False)

    def __post_init__(self) -> None:
        self.hits, self.misses = PRIOR_WEIGHT * self.prior, PRIOR_WEIGHT * (1 - self.prior)

    @property
    def rate(self) -> float:
        """The chance the next drafted token is accepted, given the previous one was."""
        return self.hits / (self.hits + self.misses)

    def record(self, accepted: int, mismatch: bool) -> None:
        self.hits = self.hits * DECAY + accepted
        self.misses = self.misses * DECAY + mismatch

    def relax(self) -> None:
        """A step the line could have drafted but was gated off: drift back toward the prior."""
        self.hits = self.hits * DECAY + PRIOR_WEIGHT * self.prior * (1 - DECAY)
        self.misses = self.misses * DECAY + PRIOR_WEIGHT * (1 - self.prior) * (1 - DECAY)


@dataclass(frozen=True)
class RowCost:
    """A step of R rows costs ``fixed + per_row * R``: only their ratio matters. ``fixed_over_row``
    infinite: rows are free, every draft is taken (tests). ``scale``: a draft model's pass against the
    target's step of as many rows (its cost in the target's row units; 0: its passes are free)."""

    fixed_over_row: float
    scale: float = 1.0

    def seconds(self, rows: int) -> float:
        """A step's cost in units of one row's."""
        return self.scale * (self.fixed_over_row + rows)


def draft_length(
    rate: float,
    most: int,
    seqs: int,
    seconds: Callable[[int], float],
    rows: int | None = None,
    tokens: float | None = None,
    spent: float = 0.0,
    extra: Callable[[int], float] | None = None,
) -> int:
    """How many of ``most`` drafted tokens (each accepted with chance ``rate`` once the one before was)
    to add to a step of ``seqs`` decoding sequences that has grown to ``rows`` rows, expected to give
    ``tokens`` tokens, by the drafts granted before (both ``seqs`` by default: no drafts yet), a step
    of R rows costing ``seconds(R)``, plus ``spent`` (a draft model's passes granted before) and
    ``extra(k)`` (what a draft of k adds to them; none by default): the count that gives the step the
    most tokens a second, if that beats the step as it is and the step without drafts by `MARGIN`;
    else 0. Each draft is judged against the step as it has grown, so eight sequences' drafts are not
    each priced as if it were the only one (a step's cost past a few rows is what stops them)."""
    rows = seqs if rows is None else rows
    tokens = seqs if tokens is None else tokens
    base = seconds(rows)
    if math.isinf(base):  # rows are free
        return most
    best, k_best = max(tokens / (base + spent), _bar(seqs, seconds)), 0
    for k in range(1, most + 1):
        cost = seconds(rows + k) + spent + (extra(k) if extra is not None else 0.0)
        value = (tokens + expected_tokens(rate, k)) / cost
        if value > best:
            best, k_best = value, k
    return k_best


def could_pay(
    rate: float,
    most: int,
    seqs: int,
    seconds: Callable[[int], float],
    rows: int | None = None,
    tokens: float | None = None,
    spent: float = 0.0,
) -> bool:
    """Whether a draft of ``most`` (arguments as `draft_length`'s) would pay if its rows cost nothing:
    if not, `draft_length` refuses it whatever rows cost (a step's cost never falls with its rows), so
    it needs no pricing, and a probe of it (`EXPLORE_EVERY`) could teach the gate nothing that changes
    its verdict. That is the case at a big batch (64 sequences: 5 drafted tokens, all kept, add under
    the `MARGIN` the bar asks) and at a low rate."""
    rows = seqs if rows is None else rows
    base = seconds(rows)
    return (
        draft_length(rate, most, seqs, lambda r: base if r >= rows else seconds(r), rows, tokens, spent) > 0
    )


def _bar(seqs: int, seconds: Callable[[int], float]) -> float:
    """The tokens a second a step with drafts must beat: the step without them's, by `MARGIN`."""
    return seqs / seconds(seqs) * (1 + MARGIN)


def expected_tokens(rate: float, k: int) -> float:
    """The drafted tokens a draft of ``k`` is expected to keep: the i-th is kept with chance rate^i."""
    return sum(rate**i for i in range(1, k + 1))


class StepTimes:
    """Decode steps' wall times by row count: each count's cost is the median of its latest `WINDOW`
    times (a loaded machine's outliers do not move it), made non-decreasing in the count (a row more
    never makes a step cheaper: isotonic regression); a count without times is interpolated between its neighbours (or
    extended from the nearest two). Seeded with the start-up probes' times, which the run's own steps
    (sampling and verification included) then replace. `refit` brings the medians up to date, every
    `FIT_EVERY` times added."""

    def __init__(self, seed: dict[int, list[float]] | None = None) -> None:
        self.times: dict[int, deque[float]] = {}
        for rows, seconds in (seed or {}).items():
            self.times[rows] = deque(seconds, maxlen=WINDOW)
        self.known: list[tuple[int, float]] = []  # (rows, cost), by rows
        self.added = 0  # times added since the seed
        self.refit()

    def add(self, rows: int, seconds: float) -> bool:
        """One more time; whether the costs were refit (every `FIT_EVERY`-th)."""
        self.times.setdefault(rows, deque(maxlen=WINDOW)).append(seconds)
        self.added += 1
        if self.added % FIT_EVERY:
            return False
        self.refit()
        return True

    def refit(self) -> None:
        """Each timed count's median, then the closest non-decreasing costs (neighbours out of order
        are pooled into their weighted mean: a noisy high count does not make the rows after it free)."""
        pools: list[list] = []  # [weighted sum, weight, row counts], costs non-decreasing
        for rows, times in sorted(self.times.items()):
            if len(times) >= MIN_TIMES:
                pools.append([median(times) * len(times), len(times), [rows]])
                while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
                    total, weight, counts = pools.pop()
                    pools[-1][0] += total
                    pools[-1][1] += weight
                    pools[-1][2] += counts
        self.known = [(rows, total / weight) for total, weight, counts in pools for rows in counts]
        self._rows = [rows for rows, _ in self.known]  # for `seconds`' bisection

    def seconds(self, rows: int) -> float:
        """A step of ``rows`` rows' cost; infinite (rows free: every draft taken) with fewer than two
        counts timed."""
        known = self.known
        if len(known) < 2:
            return math.inf
        i = bisect_left(self._rows, rows)
        if i < len(known) and known[i][0] == rows:
            return known[i][1]
        (r0, t0), (r1, t1) = known[min(max(i - 1, 0), len(known) - 2) :][:2]
        return max(t0 + (t1 - t0) / (r1 - r0) * (rows - r0), 0.0)

    def fit(self) -> RowCost | None:
        """The line ``fixed + per_row * rows`` through the counts with `MIN_TIMES` times, weighted by
        their times (the report's summary of the costs); None with fewer than two such counts. A slope
        under a thousandth of a step (noise) counts as that."""
        points = [(r, median(t), len(t)) for r, t in self.times.items() if len(t) >= MIN_TIMES]
        if len(points) < 2:
            return None
        total = sum(w for _, _, w in points)
        mean_r = sum(r * w for r, _, w in points) / total
        mean_t = sum(t * w for _, t, w in points) / total
        spread = sum(w * (r - mean_r) ** 2 for r, _, w in points)
        slope = sum(w * (r - mean_r) * (t - mean_t) for r, t, w in points) / spread
        per_row = max(slope, min(t for _, t, _ in points) * 1e-3)
        return RowCost(max(mean_t - slope * mean_r, 0.0) / per_row)


@dataclass
class Draft:
    source: str
    token_ids: list[int]
    expected: float = (
        0.0  # of its tokens, those the gate expects kept (the step's expected tokens grow by it)
    )


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
    draft_pool: object | None = None  # the draft's share of the pool (`draft_model.DraftPoolStats`)


class Speculator:
    """Proposes each decoding sequence's draft, and learns from each verification's outcome and
    (given `StepTimes`) from each decode step's time."""

    def __init__(
        self,
        config: SpeculativeConfig,
        cost: RowCost | StepTimes,
        drafter: Drafter | None = None,
        draft_cost: RowCost | StepTimes | None = None,
    ) -> None:
        """``cost``: a fixed `RowCost`, or the `StepTimes` the run's decode steps update (until two
        row counts are timed, every draft is taken). ``drafter``: the draft model (method
        ``draft_model``), which then replaces the n-gram lookups. ``draft_cost``: its passes' cost in
        ``cost``'s units (default: its own pass times, ``drafter.times``; until two row counts are
        timed there, its passes count as free)."""
        self.config = config
        self.drafter = drafter
        self.draft_cost = draft_cost or (drafter.times if drafter is not None else None)
        self._unfilled: dict[Sequence, Draft] = {}  # the step's draft-model drafts, tokens to make
        self._passes: list[int] = []  # the step's planned draft-model passes: rows of each, by depth
        self._spent = 0.0  # what the drafts granted in the step add in draft-model passes (as priced)
        self._fill_seconds = 0.0  # the step's draft-model passes' wall time (not the target's step)
        self.times = cost if isinstance(cost, StepTimes) else None
        self.cost = cost if isinstance(cost, RowCost) else cost.fit() or RowCost(float("inf"))
        self._gated = 0  # gated-off drafts free rows would pay for (every `EXPLORE_EVERY`-th runs one token)
        self._lines: dict[Request, RequestLines] = {}
        self._step = 0  # steps planned (`fill`): a request's lines are synced once a step
        self._acceptance: dict[tuple[Request, str], Acceptance] = {}
        self._totals: dict[str, list[int]] = {}  # source -> [accepted tokens, mismatches] in the run
        self.finished = FinishedLines(
            config.prompt_lookup_min, config.prompt_lookup_max, config.suffix_decoding_max_cached_requests
        )
        self.stats = SpeculationStats(config.num_speculative_tokens, self.cost.fixed_over_row)

    def _request_lines(self, req: Request) -> RequestLines:
        """``req``'s n-grams, synced with its completions' tokens at its first lookup in a step (its
        completions' tokens change only between steps, when each step's tokens are appended)."""
        lines = self._lines.get(req)
        if lines is None:
            c = self.config
            lines = self._lines[req] = RequestLines(req, c.prompt_lookup_min, c.prompt_lookup_max)
        if lines.synced != self._step:
            lines.sync(req.completions)
            lines.synced = self._step
        return lines

    def _lookup(self, seq: Sequence, room: int) -> Draft | None:
        """The tokens ``seq``'s grammar forces next; else the longest suffix of ``seq`` found earlier
        (own output, prompt, siblings' outputs, then finished lines) and up to ``room`` tokens that
        followed it."""
        if seq.logits_state is not None and (forced := seq.logits_state.forced_tokens()):
            return Draft("grammar", forced[:room])
        if self.drafter is not None:  # its tokens are made once the gate has cut the draft's length
            return Draft("draft_model", [0] * room)
        tokens = seq.token_ids
        lines = self._request_lines(seq.request)
        own, prompt = lines.lines[lines.slots[seq]].at, lines.prompt.at
        for n in range(
            min(self.config.prompt_lookup_max, len(tokens)), self.config.prompt_lookup_min - 1, -1
        ):
            key = tuple(tokens[-n:])
            at = own.get(key)
            if at is None:
                at = prompt.get(key)
            if at is not None:
                return Draft("prompt_lookup", tokens[at : at + room])
            if (found := lines.sibling(seq, key)) is not None:
                sib, at = found
                return Draft("siblings", sib.token_ids[at : at + room])
            if (follow := self.finished.follow(key, room)) is not None:
                return Draft("finished", follow)
        return None

    def propose(
        self, seq: Sequence, room: int, seqs: int, rows: int | None = None, tokens: float | None = None
    ) -> Draft | None:
        """A draft of at most ``room`` tokens for ``seq`` (decoding: one token pending) in a step of
        ``seqs`` sequences grown to ``rows`` rows and ``tokens`` expected tokens by the drafts granted
        before (`draft_length`), or None (no match, or the gate finds it would not pay)."""
        room = min(room, self.config.num_speculative_tokens)
        if room <= 0:
            return None
        draft = self._lookup(seq, room)
        if draft is None or not draft.token_ids:
            return None
        acceptance = self._line_acceptance(seq.request, draft.source)
        seconds = self.cost.seconds if self.times is None else self.times.seconds
        model = draft.source == "draft_model"
        gap = self.drafter.gap(seq) if model else 0
        extra = self._draft_model_cost(seq, gap, acceptance.rate, len(draft.token_ids)) if model else None
        rate, most = acceptance.rate, len(draft.token_ids)
        pays = could_pay(rate, most, seqs, seconds, rows, tokens, self._spent)
        k = draft_length(rate, most, seqs, seconds, rows, tokens, self._spent, extra) if pays else 0
        if k == 0:
            acceptance.relax()
            self.stats.gated += 1
            # a draft model's probe would pay its passes and the line's catch-up: not for a row's time;
            # one that would not pay with free rows cannot move the verdict: not probed
            if self.times is None or model or not pays:
                return None
            self._gated += 1
            if self._gated % EXPLORE_EVERY:
                return None
            k = 1  # now and then a row more than the gate allows: the fit learns what rows cost here
        draft.token_ids = draft.token_ids[:k]
        if model:  # its tokens are made for the whole step at once (`fill`)
            self._unfilled[seq] = draft
            self._spent += extra(k)
            self._passes[0] += gap
            for depth in range(1, k):
                self._passes[depth] += 1
        draft.expected = expected_tokens(acceptance.rate, k)
        return draft

    def _draft_model_cost(self, seq: Sequence, gap: int, rate: float, most: int) -> Callable[[int], float]:
        """What a draft of k from the draft model adds to the step's planned passes (``_passes``):
        the marginal seconds of its k passes (the first computing its pending token, the next ones a
        drafted token each), and its catch-up (the first pass's other ``gap - 1`` rows: the tokens
        whose draft K/V its blocks lack) spread over the steps its remaining tokens would take
        drafting k at ``rate``, since the catch-up is paid once for every draft after it."""
        left = max(seq.request.max_tokens - seq.num_output_tokens, 1)
        self._passes += [0] * (most - len(self._passes))
        passes, cost = self._passes, self.draft_cost

        def pass_seconds(rows: int) -> float:
            seconds = cost.seconds(rows) if rows else 0.0
            return 0.0 if math.isinf(seconds) else seconds  # untimed: free, as before it was priced

        catch_up = pass_seconds(passes[0] + gap) - pass_seconds(passes[0] + 1)
        through = [0.0]  # [k]: what a row more in each of the first k passes adds
        for rows in passes[:most]:
            through.append(through[-1] + pass_seconds(rows + 1) - pass_seconds(rows))

        def extra(k: int) -> float:
            share = min((1 + expected_tokens(rate, k)) / left, 1.0)
            return through[k] + catch_up * share

        return extra

    def fill(self, batch: list[ScheduledSeq]) -> None:
        """Make the tokens of the draft-model drafts scheduled in ``batch`` (the step's
        `ScheduledSeq`, whose ``draft`` is its `Draft`'s token list), in place, in one batch of the
        draft model's passes. A draft the model cuts short (its context full) keeps its
        length, padded with its last token: any token is verified exactly, a wrong one only costs
        its row. Called once a step, when its proposals are over."""
        self._step += 1
        self._passes, self._spent, self._fill_seconds = [], 0.0, 0.0
        if not self._unfilled:
            return
        wants = [
            (s.seq, d)
            for s in batch
            if (d := self._unfilled.get(s.seq)) is not None and s.draft is d.token_ids
        ]
        self._unfilled.clear()
        start = perf_counter()
        made = self.drafter.propose([(seq, len(d.token_ids)) for seq, d in wants]) if wants else []
        self._fill_seconds = perf_counter() - start
        for (seq, draft), tokens in zip(wants, made, strict=True):
            pad = tokens[-1] if tokens else seq.token_ids[-1]
            draft.token_ids[:] = tokens + [pad] * (len(draft.token_ids) - len(tokens))

    def verified(self, seq: Sequence, draft: Draft, accepted: int, mismatch: bool) -> None:
        """The outcome of ``draft``: its first ``accepted`` tokens kept; ``mismatch``: a drawn token
        differed (not an end of the sequence inside the draft)."""
        self._line_acceptance(seq.request, draft.source).record(accepted, mismatch)
        totals = self._totals.setdefault(draft.source, [0, 0])
        totals[0] += accepted
        totals[1] += mismatch
        counts = self.stats.sources[draft.source]
        counts.drafted += len(draft.token_ids)
        counts.accepted += accepted
        counts.steps += 1

    def _line_acceptance(self, req: Request, source: str) -> Acceptance:
        """``req``'s acceptance for ``source``; a new one starts at the source's rate in the run so far
        (accepted tokens over accepted and mismatches, two outcomes at the source's `FIRST_RATE`
        assumed)."""
        acceptance = self._acceptance.get((req, source))
        if acceptance is None:
            hits, misses = self._totals.get(source, (0, 0))
            first = FIRST_RATE.get(source, 0.5)
            rate = (hits + 2 * first) / (hits + misses + 2)
            acceptance = self._acceptance[req, source] = Acceptance(rate)
        return acceptance

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` rows (drafted ones included) took ``seconds``, the draft model's
        passes in it too (they are timed on their own, `Drafter.times`, and taken out here): with
        `StepTimes`, which refits its costs every `FIT_EVERY` times, and the cost line with them."""
        if self.times is None:
            return
        if self.times.add(rows, seconds - self._fill_seconds) and (cost := self.times.fit()) is not None:
            self.cost = cost
            self.stats.fixed_over_row = cost.fixed_over_row

    def forget(self, req: Request) -> None:
        """``req`` finished: its completions' tokens (each its prompt's tail and output) join the
        finished lines later lines draft from; drop its indexes and acceptance counts."""
        tail = max(req.num_prompt_tokens - self.config.prompt_lookup_max, 0)
        for seq in req.completions:
            if seq.num_output_tokens:
                self.finished.add(seq.token_ids[tail:])
        self._lines.pop(req, None)
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
            self.drafter.make_stats() if self.drafter is not None else None,
        )

    def reset_stats(self) -> None:
        self.stats = SpeculationStats(self.config.num_speculative_tokens, self.cost.fixed_over_row)
        if self.drafter is not None:
            self.drafter.reset_stats()

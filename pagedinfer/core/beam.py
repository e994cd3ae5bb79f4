"""Beam search bookkeeping for one request: which candidates run on, which finish, when to stop.

The rules are transformers' (``GenerationMixin._beam_search``), on plain lists, so the beams equal
``generate(num_beams=K, do_sample=False, num_return_sequences=K)``:

- every step the live beams' next-token log-probabilities, added to their cumulative log-probability,
  give the ``max(2, 1 + number of stop ids) * K`` best candidates (``beam_candidates`` in the sampler);
- the first K candidates that do not stop run on (a parent with several children is forked, one
  with none is pruned);
- among the first K candidates, those that stop (a stop id, or ``max_tokens`` reached) enter the
  finished list, scored ``cumulative_logprob / length ** length_penalty``; the list keeps the best K;
- the search ends when no running candidate is left, when ``early_stopping is True`` and K beams
  finished, or when the best running beam cannot beat the worst finished one (scored at its current
  length, or at ``max_tokens`` for ``early_stopping == "never"`` with a positive length penalty).

Which physical blocks the beams share is the scheduler's business (``Scheduler._step_beams``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Candidate:
    beam: int  # the parent's position among the live beams
    token: int
    cumulative_logprob: float


@dataclass
class Hypothesis:
    """A finished beam."""

    token_ids: list[int]  # generated tokens, the stop token included
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" or "length"


@dataclass
class BeamSearch:
    width: int
    max_tokens: int
    length_penalty: float
    early_stopping: bool | str
    stop_ids: frozenset[int]
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most ``width``
    improvable: bool = True  # the running beams may still beat the worst finished one
    done: bool = False

    @property
    def num_candidates(self) -> int:
        """Candidates drawn per step: enough that ``width`` of them do not stop."""
        return max(2, 1 + len(self.stop_ids)) * self.width

    def step(self, candidates: list[Candidate], outputs: list[list[int]]) -> list[Candidate]:
        """Take this step's candidates (best first) of the live beams whose generated tokens are
        ``outputs``; record the finished ones and return those that run on (best first).
        """
        length = len(outputs[0]) + 1  # every live beam has generated the same number of tokens
        stops = [c.token in self.stop_ids for c in candidates]
        ends = [s or length >= self.max_tokens for s in stops]
        running = [c for c, end in zip(candidates, ends, strict=True) if not end][: self.width]
        full = len(self.finished) == self.width
        if self.improvable and not (full and self.early_stopping is True):
            for c, end, stop in zip(candidates[: self.width], ends, stops, strict=False):
                if end:
                    score = c.cumulative_logprob / length**self.length_penalty
                    reason = "stop" if stop else "length"
                    self.finished.append(
                        Hypothesis([*outputs[c.beam], c.token], c.cumulative_logprob, score, reason)
                    )
            self.finished.sort(key=lambda h: h.score, reverse=True)  # stable: earlier ones win ties
            del self.finished[self.width :]
        if self.improvable and running:
            horizon = length
            if self.early_stopping == "never" and self.length_penalty > 0:
                horizon = self.max_tokens
            best = running[0].cumulative_logprob / horizon**self.length_penalty
            self.improvable = len(self.finished) < self.width or best > self.finished[-1].score
        full = len(self.finished) == self.width
        self.done = not running or not self.improvable or (full and self.early_stopping is True)
        return [] if self.done else running

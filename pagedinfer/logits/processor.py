"""The one seam for everything that shapes logits: a processor validates a request's parameters once,
may keep per-sequence state, is applied to all of a step's rows that use it in one call, and (through
its state) is told each token the sequence appends.

The model is vLLM v1's ``LogitsProcessor`` (validate, update state, apply) with llama.cpp's ``accept``:

* ``validate(params)``: the checks that need the model (token ids against the vocabulary, a grammar
  that must compile); `engine.intake.prepare` runs them once per request, so a bad value is that
  request's error alone.
* ``new_state(params)`` (stateful processors only): the state of one sequence at its first generated
  token. The sequence holds it (`LogitsState`), forks it when the sequence forks (beam search) and
  tells it every appended token (``accept``); a request run again from its prompt gets new states.
* ``prepare(rows)`` (optional): work that depends only on the states, started before the forward
  pass so it overlaps with it (grammar masks).
* ``apply(logits, index, rows)``: shape ``logits[index]`` in place, one call for all those rows.

`LogitsPipeline` applies the processors in vLLM's order: allowed_token_ids, bad_words, min_tokens,
logit_bias, the penalties, then the grammar mask; temperature and the top-k/top-p/min-p filters stay
the sampler's fixed fast path. A row no processor applies to costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pagedinfer.sampling_params import SamplingParams


@dataclass
class Row:
    """One logits row of a step as the processors see it: a sequence's settings, tokens and state."""

    params: SamplingParams
    token_ids: list[int]  # prompt + generated tokens
    num_prompt_tokens: int
    state: LogitsState | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class LogitsProcessor:
    """The interface (stateless by default); subclasses override what they need."""

    name = ""
    masks = False  # may exclude tokens (logits to -inf): the rows it shaped are checked for a survivor

    def wants(self, params: SamplingParams) -> bool:
        raise NotImplementedError

    def validate(self, params: SamplingParams) -> str | None:
        return None

    def overflows(self, params: SamplingParams) -> str | None:
        """The setting of ``params`` with which this processor can turn a finite logit into NaN or an
        infinity (``repetition_penalty=1e-40``), or None: a row it applies to is then checked for a
        finite maximum before the pipeline, so that a row that ends non-finite names its cause."""
        return None

    def new_state(self, params: SamplingParams) -> SequenceState | None:
        return None

    def prepare(self, rows: list[Row]) -> None:
        return None

    def apply(self, logits: torch.Tensor, index: list[int], rows: list[Row]) -> None:
        raise NotImplementedError


class SequenceState(Protocol):
    """One processor's state for one sequence."""

    finished: bool  # nothing may follow (a completed grammar): the sequence stops

    def accept(self, token: int) -> None: ...

    def fork(self) -> SequenceState: ...

    # optional: ``forced_tokens() -> list[int]``, the tokens that alone may come next (a grammar's
    # fixed text), which speculative decoding drafts


class LogitsState:
    """A sequence's processor states by processor name: forked with the sequence, told each token."""

    def __init__(self, states: dict[str, SequenceState]) -> None:
        self.states = states

    def get(self, name: str) -> Any:
        return self.states.get(name)

    def accept(self, token: int) -> None:
        for state in self.states.values():
            state.accept(token)

    def fork(self) -> LogitsState:
        return LogitsState({name: s.fork() for name, s in self.states.items()})

    @property
    def finished(self) -> bool:
        return any(s.finished for s in self.states.values())

    def forced_tokens(self) -> list[int]:
        """The tokens a state forces next (a grammar's fixed text: speculative decoding's free drafts);
        empty when none does."""
        for state in self.states.values():
            forced = getattr(state, "forced_tokens", None)
            if forced is not None and (tokens := forced()):
                return tokens
        return []


class LogitsPipeline:
    """The engine's processors, in the order they shape a row."""

    def __init__(self, processors: list[LogitsProcessor]) -> None:
        self.processors = processors

    def validate(self, params: SamplingParams) -> str | None:
        """The first processor's objection to ``params``; asked only when ``params.shapes_logits``
        (a request no processor applies to never reaches the pipeline)."""
        for p in self.processors:
            if p.wants(params) and (why := p.validate(params)) is not None:
                return why
        return None

    def new_state(self, params: SamplingParams) -> LogitsState | None:
        """A new sequence's states, or None when no stateful processor applies to ``params``; asked
        only when ``params.shapes_logits``."""
        states = {p.name: p.new_state(params) for p in self.processors if p.wants(params)}
        states = {name: s for name, s in states.items() if s is not None}
        return LogitsState(states) if states else None

    def prepare(self, rows: list[Row]) -> None:
        """Start the step's state-only work (before the forward pass, which it overlaps)."""
        if not any(r.params.shapes_logits for r in rows):
            return
        for p in self.processors:
            p.prepare(rows)

    def overflowing(self, rows: list[Row]) -> dict[int, str]:
        """The rows whose processors can turn a finite logit non-finite, with the settings that can."""
        out = {}
        for i, r in enumerate(rows):
            if r.params.shapes_logits:
                found = [w for p in self.processors if p.wants(r.params) and (w := p.overflows(r.params))]
                if found:
                    out[i] = ", ".join(found)
        return out

    def apply(self, logits: torch.Tensor, rows: list[Row]) -> list[int]:
        """Shape ``logits [len(rows), V]`` in place; return the rows left with no token to draw."""
        shaped = [i for i, r in enumerate(rows) if r.params.shapes_logits]
        if not shaped:
            return []
        masked: set[int] = set()
        for p in self.processors:
            index = [i for i in shaped if p.wants(rows[i].params)]
            if index:
                p.apply(logits, index, [rows[i] for i in index])
                if p.masks:
                    masked.update(index)
        if not masked:
            return []
        check = sorted(masked)
        # [len(check)] the best logit left in each row a processor masked: -inf means none is left
        best = logits[torch.tensor(check, device=logits.device)].amax(dim=1)
        return [check[j] for j in torch.nonzero(best == float("-inf")).flatten().tolist()]

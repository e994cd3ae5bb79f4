"""Requests and their sequences: the prompt sequence that is prefilled once, and the n completions forked from it.

Only the scheduler changes a sequence's state (tokens computed, tokens appended, finished); the
engine reads them to build outputs. No tensors here: a completion's random source, its incremental
detokenizer and its logits processors' state (a grammar matcher) are made by the engine and held
as opaque objects.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pagedinfer.core.beam import BeamSearch
from pagedinfer.outputs import CompletionOutput, Logprob, RequestOutput
from pagedinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedinfer.lora.registry import LoadedAdapter


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TextStream(Protocol):
    """A completion's incremental detokenizer: text so far, and stop-string detection per token."""

    text: str

    def step(self, token_id: int) -> str | None: ...


class LogitsStateLike(Protocol):
    """A completion's logits processors' state (`pagedinfer.logits.processor.LogitsState`)."""

    finished: bool  # its grammar is complete: the completion stops

    def accept(self, token: int) -> None: ...

    def fork(self) -> LogitsStateLike: ...

    def forced_tokens(self) -> list[int]: ...


@dataclass(eq=False)
class Sequence:
    """One row of K/V in the pool: the prompt sequence, or one completion after the fork.

    ``token_ids`` holds prompt + generated tokens; the first ``num_computed`` have K/V in the pool.
    The tokens still to compute are ``token_ids[num_computed:]``: a prompt (chunk), the one token
    sampled last step, or, after a preemption, a completion's whole output being recomputed.
    """

    request: Request
    index: int  # completion index (0 for the prompt sequence, which samples none itself)
    is_prompt: bool
    token_ids: list[int]
    num_prompt_tokens: int
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    generator: Any = None  # the sampler's random source for this completion (opaque here)
    detok: TextStream | None = None
    logits_state: LogitsStateLike | None = None  # forked with the sequence, told every appended token
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    capped_by: str | None = None  # the request's cap when it ended it ("length")

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def lora_slot(self) -> int:
        return self.request.lora_slot

    @property
    def name(self) -> str:
        rid = self.request.request_id
        return f"{rid}/prompt" if self.is_prompt else f"{rid}/{self.index}"

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detok.text if self.detok else "",
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            cumulative_logprob=None if self.logprobs is None else self.cumulative_logprob,
            logprobs=self.logprobs,
            stop_reason=self.stop_reason,
            capped_by=self.capped_by,
        )


@dataclass
class KeptCompletion:
    """What an earlier run had generated of one unfinished line's completion (``--resume`` inside a
    line): its tokens and, when the line asks for logprobs, their entries. Replayed through the same
    code as a fresh token (`Scheduler` appends it), so stops, text and grammar state come out the same."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None  # one entry per token, its own token in it


@dataclass
class KeptLine:
    """What an earlier run generated of a line it did not finish: its completions' tokens, for the
    request `request_identity` names (another seed, prompt or n is not that request)."""

    identity: str
    completions: dict[int, KeptCompletion]


def request_identity(seed: int, prompt_token_ids: list[int], n: int) -> str:
    """What kept completions belong to: a request with this seed, prompt and n (``--resume`` checks
    that the line it replays them into is still that request)."""
    digest = hashlib.blake2b(f"{seed}/{n}/{prompt_token_ids}".encode(), digest_size=8)
    return digest.hexdigest()


class CompletionStates(Protocol):
    """What a new completion starts with: its random source, detokenizer and logits state (the engine
    makes them, `engine.completion_state`; the scheduler asks when it first admits a request)."""

    def __call__(self, req: Request, index: int) -> tuple[Any, TextStream | None, LogitsStateLike | None]: ...


@dataclass(eq=False)
class Request:
    """One prompt with its sampling parameters; runs as one prompt sequence, then n completions."""

    request_id: str
    order: int  # position in the caller's input (outputs come back in this order)
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens capped by the model's context
    seed: int = 0  # the base seed of its completions' random sources
    state: RequestState = RequestState.WAITING
    prompt_seq: Sequence | None = None
    completions: list[Sequence] = field(default_factory=list)  # made at first admission
    error: str | None = None
    num_preemptions: int = 0
    num_overtaken: int = 0  # later arrivals admitted before it (the ``lpm`` policy's starvation bound)
    prompt_hashes: list[bytes] | None = (
        None  # its full prompt blocks' chained hashes (the KV-cache manager's)
    )
    beam: BeamSearch | None = None  # set for beam search: ``completions`` are then the live beams, best first
    # with params.prompt_logprobs: per prompt position, the entry of its token (None for the first)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_upto: int = 1  # positions below this have their entry
    lora: LoadedAdapter | None = None  # the adapter its rows run with (None: the base model)
    lora_slot: int = 0  # the slot its adapter holds while it runs (set at each admission; 0: the base model)
    # the per-run cap that set ``max_tokens``, if one did: "max_line_tokens" (below the request's own
    # limit) or "line_timeout" (`cap_at_next_token`); a completion it ends says so
    cap: str | None = None
    started_s: float | None = None  # the scheduler's clock when first admitted (None: never yet)
    # by completion index: what an earlier run generated (``--resume``), replayed at first admission
    kept: dict[int, KeptCompletion] | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt positions still lack their logprobs (its prompt chunks return every row)."""
        return self.prompt_logprobs is not None and self.prompt_logprobs_upto < self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def adapter_digest(self) -> bytes:
        """What its K/V is computed with beside the base weights (``b""``: the base model alone)."""
        return b"" if self.lora is None else self.lora.digest

    def live_seqs(self) -> list[Sequence]:
        """The sequences that still run: the prompt sequence until the fork, then unfinished completions."""
        if self.prompt_seq is not None:
            return [self.prompt_seq]
        return [s for s in self.completions if not s.finished]

    def num_future_seqs(self) -> int:
        """Sequences this request occupies in a batch, counting completions not forked yet."""
        if not self.completions or (self.beam is not None and not self.beam.done):
            return self.params.n  # a beam search runs up to beam_width (= n) beams
        return sum(not s.finished for s in self.completions)

    @property
    def sampled_yet(self) -> bool:
        """Whether its completions hold generated tokens (a resumed request's prompt then samples none)."""
        return any(s.num_output_tokens for s in self.completions)

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.error is not None or self.beam.done
        return self.error is not None or (
            bool(self.completions) and all(s.finished for s in self.completions)
        )

    def cap_at_next_token(self, cap: str) -> None:
        """End every unfinished completion (or the beam search) at its next sampled token with
        finish_reason "length" marked ``cap``: a completion behind the longest unfinished one (a step's
        token budget skipped it) catches up with it first."""
        longest = max((s.num_output_tokens for s in self.completions if not s.finished), default=0)
        self.max_tokens = min(self.max_tokens, longest + 1)
        self.cap = cap
        if self.beam is not None:
            self.beam.max_tokens = self.max_tokens

    def kept_draws(self, index: int) -> int:
        """Random numbers completion ``index``'s kept tokens drew: one per sampled token (none greedy)."""
        kept = self.kept.get(index) if self.kept else None
        return 0 if kept is None or self.params.greedy else len(kept.token_ids)

    def tokens_so_far(self) -> int:
        """Tokens its unfinished and finished completions (or live beams) hold now."""
        return sum(s.num_output_tokens for s in self.completions)

    def completion_tokens(self) -> int:
        """Tokens the caller gets back: every completion's, or the finished beams' (not those search pruned)."""
        if self.beam is not None:
            return sum(len(h.token_ids) for h in self.beam.finished)
        return sum(len(s.output_ids) for s in self.completions)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.to_output() for s in self.completions],
            finished=self.finished,
            error=self.error,
            prompt_logprobs=self.prompt_logprobs,
        )

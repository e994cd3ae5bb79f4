"""What `LLM.generate` returns: one `RequestOutput` per prompt, n `CompletionOutput`s each."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop token or stop string), "length", or None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: sampled + top-k
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # the per-run cap that ended it with finish_reason "length": "max_line_tokens" or "line_timeout"
    capped_by: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    error: str | None = None  # set when the request could not run (e.g. prompt too long)
    # with SamplingParams.prompt_logprobs: per prompt token, its logprob and the top k (None for the first)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class BeamSearchSequence:
    token_ids: list[int]  # generated tokens (the stop token included)
    text: str
    cumulative_logprob: float  # sum of the generated tokens' log-probabilities
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty: the beams' order
    finish_reason: str  # "stop" (EOS or a stop token) or "length"
    capped_by: str | None = None  # as `CompletionOutput.capped_by`


@dataclass
class BeamSearchOutput:
    """What `LLM.beam_search` returns per prompt: ``beam_width`` sequences, best first."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)
    error: str | None = None

"""How to sample one request: vLLM's `SamplingParams` fields, validated when built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    """Per-request sampling settings (the names and defaults vLLM users know).

    ``temperature == 0`` means greedy. ``seed`` makes the request reproducible on its own or
    amid any others: sample ``i`` draws from a generator derived from (seed, prompt, i).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # top-k logprobs per generated token (0: the sampled token only)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (isinstance(self.n, int) and self.n >= 1, "n must be an integer >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be -1, 0 or a positive integer"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens must be <= max_tokens",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (all(isinstance(t, int) for t in self.stop_token_ids), "stop_token_ids must be integers"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs must be >= 0"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class BeamSearchParams:
    """Beam search settings, with transformers' ``generate(num_beams=...)`` semantics.

    ``length_penalty``: a finished beam's score is ``cumulative_logprob / generated_length **
    length_penalty``. ``early_stopping``: ``True`` stops once ``beam_width`` beams finished;
    ``False`` stops when the best running beam, scored at its current length, cannot beat the
    worst finished one; ``"never"`` scores it at ``max_tokens`` when ``length_penalty > 0``.
    A beam finishes at the model's EOS (unless ``ignore_eos``), at one of ``stop_token_ids``, or
    at ``max_tokens``.
    """

    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = [
            (isinstance(self.beam_width, int) and self.beam_width >= 1, "beam_width must be an integer >= 1"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be an integer >= 1"),
            (self.early_stopping in (True, False, "never"), "early_stopping must be true, false or 'never'"),
            (all(isinstance(t, int) for t in self.stop_token_ids), "stop_token_ids must be integers"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def n(self) -> int:
        """Sequences the request returns (and occupies): one per beam."""
        return self.beam_width

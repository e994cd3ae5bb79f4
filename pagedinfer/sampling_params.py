"""How to sample one request: vLLM's `SamplingParams` fields, validated when built.

Every value that could later break the sampler (a NaN, an infinite or vanishing temperature, a
seed too large for the generator derivation, a float where a count belongs, a lone surrogate in a
stop string) is refused here, so a bad value fails its own request before anything runs. Checks
that need the model (``logprobs`` against the vocabulary) live in `LLMEngine.params_error`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Temperatures in (0, MIN_TEMPERATURE) are refused: logits / 1e-40 overflow float32 to inf and the
# sampler would draw the same token forever. 0 stays "greedy". vLLM clamps to the same 0.01.
MIN_TEMPERATURE = 1e-2
# Seeds are derived into a 128-bit signed field (`Request.sample_generator`); this range fits in it
# and covers both signed and unsigned 64-bit seeds.
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1


def is_int(value: object) -> bool:
    """An integer that is not a bool (``True`` is an int to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite real number (int or float, not bool, not NaN or infinite)."""
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def unicode_error(text: str) -> str | None:
    """Why ``text`` cannot be encoded as UTF-8 (a lone surrogate such as ``\\ud800``), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"is not valid Unicode (lone surrogate \\u{ord(text[e.start]):04x} at character {e.start})"
    return None


@dataclass
class SamplingParams:
    """Per-request sampling settings (the names and defaults vLLM users know).

    ``temperature == 0`` means greedy; otherwise it must be at least `MIN_TEMPERATURE`. ``seed``
    (from `MIN_SEED` to `MAX_SEED`) makes the request reproducible on its own or amid any others:
    sample ``i`` draws from a generator derived from (seed, prompt, i).
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
        if not isinstance(self.stop, (list, tuple)) and self.stop is not None:
            raise ValueError("stop must be a string or a list of strings")
        if not isinstance(self.stop_token_ids, (list, tuple)) and self.stop_token_ids is not None:
            raise ValueError("stop_token_ids must be a list of integers")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        for message in self._errors():
            raise ValueError(message)

    def _errors(self):
        """Each failed check's message, in field order (the first one is raised)."""
        numbers = (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        )
        for name in numbers:
            if not is_number(getattr(self, name)):
                yield f"{name} must be a finite number, not {getattr(self, name)!r}"
        ints = {
            "n": False,
            "top_k": False,
            "max_tokens": True,
            "min_tokens": False,
            "seed": True,
            "logprobs": True,
        }
        for name, nullable in ints.items():
            value = getattr(self, name)
            if not (is_int(value) or (nullable and value is None)):
                yield f"{name} must be an integer{' or None' if nullable else ''}, not {value!r}"
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                yield f"{name} must be true or false, not {getattr(self, name)!r}"
        checks = [
            (self.n >= 1, "n must be an integer >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (
                self.temperature == 0 or self.temperature >= MIN_TEMPERATURE,
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}",
            ),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be -1, 0 or a positive integer"),
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
            (
                all(is_int(t) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be non-negative integers",
            ),
            (self.logprobs is None or self.logprobs >= 0, "logprobs must be >= 0"),
            (
                self.seed is None or MIN_SEED <= self.seed <= MAX_SEED,
                f"seed must be an integer from -2**63 to 2**64 - 1, not {self.seed}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                yield message
                return
        for s in self.stop:
            if (why := unicode_error(s)) is not None:
                yield f"stop string {why}"

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

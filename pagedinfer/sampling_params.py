"""How to sample one request: vLLM's `SamplingParams` fields, validated when built.

Every value that could later break the sampler (a NaN, an infinite or vanishing temperature, a
seed too large for the generator derivation, a float where a count belongs, a lone surrogate in a
stop string) is refused here, so a bad value fails its own request before anything runs. Checks
that need the model (``logprobs`` against the vocabulary) live in `LLMEngine.params_error`.
"""

from __future__ import annotations

import json
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


LOGIT_BIAS_LIMIT = 100.0  # OpenAI's bound on a logit_bias value
# the ways to constrain an output, vLLM's names; exactly one is given
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrain every sample of a request to a JSON schema, a regex, a choice or a grammar (vLLM's names).

    ``json``: a JSON schema (a dict, or its JSON text); ``json_object``: any JSON object; ``regex``: the
    whole output matches it; ``choice``: the output is one of these strings; ``grammar``: a Lark
    (EBNF) or llama.cpp GBNF grammar. ``disable_any_whitespace``: JSON without whitespace between
    tokens (shorter outputs, and no sample can spend its tokens on blank space). Plain data, so it
    crosses to Ray replicas; the grammar is compiled by the engine (`LLMEngine.params_error`).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            got = f" (got {', '.join(given)})" if given else ""
            raise ValueError(
                f"structured_outputs must give exactly one of {', '.join(STRUCTURED_KINDS)}{got}"
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"structured_outputs.json is not valid JSON ({e.msg} at column {e.colno})"
                ) from None
        checks = [
            ("json", self.json is None or isinstance(self.json, dict), "must be a JSON schema object"),
            ("regex", self.regex is None or isinstance(self.regex, str) and self.regex, "must be a string"),
            (
                "choice",
                self.choice is None
                or isinstance(self.choice, (list, tuple))
                and self.choice
                and all(isinstance(c, str) and c for c in self.choice),
                "must be a non-empty list of non-empty strings",
            ),
            (
                "grammar",
                self.grammar is None or isinstance(self.grammar, str) and self.grammar,
                "must be a string",
            ),
            ("json_object", self.json_object in (None, True, False), "must be true or false"),
            (
                "disable_any_whitespace",
                isinstance(self.disable_any_whitespace, bool),
                "must be true or false",
            ),
        ]
        for name, ok, reason in checks:
            if not ok:
                raise ValueError(f"structured_outputs.{name} {reason}")
        if self.choice is not None:
            self.choice = list(self.choice)
        for name in ("regex", "grammar", *([] if self.choice is None else ["choice"])):
            for text in [getattr(self, name)] if name != "choice" else self.choice:
                if isinstance(text, str) and (why := unicode_error(text)) is not None:
                    raise ValueError(f"structured_outputs.{name} {why}")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """The same text for equal constraints: what the engine's compile cache is keyed by."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.disable_any_whitespace], sort_keys=True)


def _structured(value: object) -> StructuredOutputsParams | None:
    """``structured_outputs`` as given (an object, a JSON dict of its fields, or None) -> the object."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs must be an object with one of {', '.join(STRUCTURED_KINDS)}")
    unknown = sorted(set(value) - {*STRUCTURED_KINDS, "disable_any_whitespace"})
    if unknown:
        raise ValueError(
            f"structured_outputs has unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
        )
    return StructuredOutputsParams(**value)


def _logit_bias(value: object) -> dict[int, float] | None:
    """OpenAI's ``{"token id": bias}`` (string keys from JSON) or ``{id: bias}`` -> ``{int: float}``."""
    if value is None:
        return None
    words = f"logit_bias must map token ids to numbers in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
    if not isinstance(value, dict):
        raise ValueError(f"{words}, not {type(value).__name__}")
    out = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not is_int(token) or token < 0:
            raise ValueError(f"{words}, not the key {key!r}")
        if not is_number(bias) or abs(bias) > LOGIT_BIAS_LIMIT:
            raise ValueError(f"{words}, not {bias!r} for token {token}")
        out[token] = float(bias)
    return out


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
    # top-k logprobs of every prompt token but the first (0: the token itself), vLLM's meaning
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # OpenAI's: added to these tokens' logits
    allowed_token_ids: list[int] | None = None  # only these tokens can be generated
    bad_words: list[str] | None = None  # words never generated (tokenized with and without a leading space)
    structured_outputs: StructuredOutputsParams | None = None

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
        self.logit_bias = _logit_bias(self.logit_bias)
        self.structured_outputs = _structured(self.structured_outputs)
        for message in _logit_control_errors(self):
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
            "prompt_logprobs": True,
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
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs must be >= 0"),
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
    def shapes_logits(self) -> bool:
        """Whether anything besides temperature and the top-k/top-p/min-p filters changes its logits."""
        return bool(
            self.penalized
            or self.min_tokens
            or self.logit_bias
            or self.allowed_token_ids
            or self.bad_words
            or self.structured_outputs
        )

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _logit_control_errors(p: SamplingParams):
    """Checks of the logit controls that need no model (those against the vocabulary: `LLMEngine.params_error`)."""
    for name in ("allowed_token_ids", "bad_words"):
        value = getattr(p, name)
        if value is not None and not isinstance(value, (list, tuple)):
            yield f"{name} must be a list, not {type(value).__name__}"
            return
    if p.allowed_token_ids is not None:
        p.allowed_token_ids = list(p.allowed_token_ids)
        if not p.allowed_token_ids or not all(is_int(t) and t >= 0 for t in p.allowed_token_ids):
            yield "allowed_token_ids must be a non-empty list of non-negative integers"
    if p.bad_words is not None:
        p.bad_words = list(p.bad_words)
        if not all(isinstance(w, str) and w.strip() for w in p.bad_words):
            yield "bad_words must be a list of non-blank strings"
        for w in p.bad_words:
            if (why := unicode_error(w)) is not None:
                yield f"bad_words string {why}"


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
    structured_outputs: StructuredOutputsParams | None = None  # every beam follows the constraint

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.structured_outputs = _structured(self.structured_outputs)
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

    def sampling_params(self) -> SamplingParams:
        """The greedy settings its beams run with (one sequence per beam)."""
        return SamplingParams(
            n=self.beam_width,
            temperature=0,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids,
            structured_outputs=self.structured_outputs,
        )

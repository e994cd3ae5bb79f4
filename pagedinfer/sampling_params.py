"""How to sample one request: vLLM's `SamplingParams` fields, validated when built.

Each field is declared once, here, with the JSON kinds it accepts (`json_kinds`): the Python API,
the CLI's plain JSONL lines and OpenAI batch bodies all take these fields by these names, and the
type checks and their messages come from the declaration. Every value that could later break the
sampler (a NaN, an infinite or vanishing temperature, an integer too large for a 64-bit tensor, a
float where a count belongs, a lone surrogate in a stop string) is refused here, so a bad value
fails its own request before anything runs. Checks that need the model (``logprobs`` against the
vocabulary) live in `engine.intake.prepare`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

# Temperatures in (0, MIN_TEMPERATURE) are refused: logits / 1e-40 overflow float32 to inf and the
# sampler would draw the same token forever. 0 stays "greedy". vLLM clamps to the same 0.01.
MIN_TEMPERATURE = 1e-2
# Seeds are derived into a 128-bit signed field (`seeding.completion_seed`); this range fits in it and
# covers both signed and unsigned 64-bit seeds.
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1
MAX_INT = (1 << 63) - 1  # every other integer field must fit a 64-bit tensor

_KIND_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "strs": "a list of strings",
    "ints": "a list of integers",
    "object": "an object",
    "null": "null",
}


class ParamError(ValueError):
    """A field's value is refused; ``str()`` is ``"<field> <reason>"`` (the CLI prefixes ``body.``)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name} {reason}")
        self.field = name
        self.reason = reason


def kinds(*names: str, line: bool = True) -> dict:
    """Field metadata: the JSON kinds a field accepts; ``line=False`` keeps it out of JSONL lines."""
    return {"json": names, "line": line}


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


def describe(value: object) -> str:
    """A value's JSON type in words, for messages ("a string", "a number (1.5)")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        text = repr(value)
        return f"a number ({text if len(text) <= 24 else text[:20] + '…'})"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


# each JSON kind as Python types (a list kind: the type of its items); a bool is an int to Python, never
# a number or a count to a user
_SCALAR_KINDS = {"int": int, "float": (int, float), "bool": bool, "str": str, "null": type(None)}
_LIST_KINDS = {"strs": str, "ints": int}


def _is_item(item: object, kind: str) -> bool:
    """Whether ``item`` may stand in a list of the list kind ``kind`` ("strs", "ints")."""
    return type(item) is not bool and isinstance(item, _LIST_KINDS[kind])


def _describe_list(value: object, accepted: tuple[str, ...]) -> str:
    """``describe(value)``, plus a list's first wrong item and its index where a list kind is accepted:
    "not a list" alone would not say what is wrong with ``["a", 5]``."""
    list_kinds = [k for k in accepted if k in _LIST_KINDS]
    if not isinstance(value, (list, tuple)) or not list_kinds:
        return describe(value)
    for i, item in enumerate(value):
        if not any(_is_item(item, k) for k in list_kinds):
            return f"a list holding {describe(item)} at index {i}"
    return describe(value)


def check_kinds(params: object) -> None:
    """Refuse the first field of a params dataclass whose value is not of a declared JSON kind (every
    request builds its params, so the tests are inline rather than a call per field and kind)."""
    for f in dataclasses.fields(params):
        accepted = f.metadata.get("json")
        value = getattr(params, f.name)
        boolean = type(value) is bool
        if accepted and not any(
            isinstance(value, _SCALAR_KINDS[k]) and (k == "bool" or not boolean)
            if k in _SCALAR_KINDS
            else isinstance(value, (list, tuple)) and all(_is_item(v, k) for v in value)
            if k in _LIST_KINDS
            else isinstance(value, dict) or dataclasses.is_dataclass(value)  # "object", or its dataclass
            for k in accepted
        ):
            raise ParamError(
                f.name,
                f"must be {' or '.join(_KIND_WORDS[k] for k in accepted)}, not {_describe_list(value, accepted)}",
            )
        if (
            isinstance(value, int)
            and not boolean
            and not (f.name == "seed" or -MAX_INT - 1 <= value <= MAX_INT)
        ):
            raise ParamError(f.name, f"must be below 2**63, not an integer of {len(str(abs(value)))} digits")


def line_fields(cls: type) -> dict[str, tuple[str, ...]]:
    """The fields a JSONL line may set on ``cls`` (a params dataclass), with their JSON kinds."""
    return {f.name: f.metadata["json"] for f in dataclasses.fields(cls) if f.metadata.get("line", False)}


LOGIT_BIAS_LIMIT = 100.0  # OpenAI's bound on a logit_bias value
# the ways to constrain an output, vLLM's names; exactly one is given
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# JSON's whitespace by default: one space, or a newline and up to 20 spaces or tabs of indentation
# (llama.cpp's bound), at each place JSON allows whitespace (llguidance matches it at most once
# there): pretty-printed JSON passes, a completion cannot spend its tokens on runs of blank space
BOUNDED_JSON_WHITESPACE = r"\x20|\n[\x20\x09]{0,20}"
# any run of JSON whitespace anywhere (llguidance's and vLLM's default), on request
UNBOUNDED_JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]+"


@dataclass
class StructuredOutputsParams:
    """Constrain every completion of a request to a JSON schema, a regex, a choice or a grammar (vLLM's names).

    ``json``: a JSON schema (a dict, or its JSON text); ``json_object``: any JSON object; ``regex``: the
    whole output matches it; ``choice``: the output is one of these strings; ``grammar``: a Lark
    (EBNF) or llama.cpp GBNF grammar. ``disable_any_whitespace``: JSON without whitespace between
    tokens. ``whitespace_pattern``: the regex JSON's whitespace matches at each place it may go (vLLM's
    name); by default `BOUNDED_JSON_WHITESPACE`, `UNBOUNDED_JSON_WHITESPACE` for any. Plain data, so
    it crosses to Ray replicas; the grammar is compiled by the engine (`engine.intake.prepare`).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            got = f" (got {', '.join(given)})" if given else ""
            raise ParamError(
                "structured_outputs", f"must give exactly one of {', '.join(STRUCTURED_KINDS)}{got}"
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ParamError(
                    "structured_outputs.json", f"is not valid JSON ({e.msg} at character {e.pos + 1})"
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
            (
                "whitespace_pattern",
                self.whitespace_pattern is None
                or isinstance(self.whitespace_pattern, str)
                and self.whitespace_pattern,
                "must be a non-empty string (a regex)",
            ),
            (
                "whitespace_pattern",
                self.whitespace_pattern is None or not self.disable_any_whitespace,
                "cannot be given with disable_any_whitespace",
            ),
            (
                "whitespace_pattern",
                self.whitespace_pattern is None or self.json is not None or self.json_object,
                "applies to json and json_object only",
            ),
        ]
        for name, ok, reason in checks:
            if not ok:
                raise ParamError(f"structured_outputs.{name}", reason)
        if self.choice is not None:
            self.choice = list(self.choice)
        for name in ("regex", "grammar", "whitespace_pattern", *([] if self.choice is None else ["choice"])):
            for text in [getattr(self, name)] if name != "choice" else self.choice:
                if isinstance(text, str) and (why := unicode_error(text)) is not None:
                    raise ParamError(f"structured_outputs.{name}", why)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """The same text for equal constraints: what the engine's compile cache is keyed by."""
        value = getattr(self, self.kind)
        return json.dumps(
            [self.kind, value, self.disable_any_whitespace, self.whitespace_pattern], sort_keys=True
        )


def _structured(value: object) -> StructuredOutputsParams:
    """``structured_outputs`` as given (an object, or a JSON dict of its fields) -> the object."""
    if isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise ParamError("structured_outputs", f"must be an object with one of {', '.join(STRUCTURED_KINDS)}")
    unknown = sorted(set(value) - {*STRUCTURED_KINDS, "disable_any_whitespace", "whitespace_pattern"})
    if unknown:
        s = "s" if len(unknown) > 1 else ""
        raise ParamError("structured_outputs", f"has unknown field{s} {', '.join(map(repr, unknown))}")
    return StructuredOutputsParams(**value)


def _logit_bias(value: object) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` (string keys from JSON) or ``{id: bias}`` -> ``{int: float}``."""
    words = f"must map token ids to numbers in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
    if not isinstance(value, dict):
        raise ParamError("logit_bias", f"{words}, not {describe(value)}")
    out = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not is_int(token) or token < 0:
            raise ParamError("logit_bias", f"{words}, not the key {key!r}")
        if not is_number(bias) or abs(bias) > LOGIT_BIAS_LIMIT:
            raise ParamError("logit_bias", f"{words}, not {bias!r} for token {token}")
        out[token] = float(bias)
    return out


@dataclass
class SamplingParams:
    """Per-request sampling settings (the names and defaults vLLM users know).

    ``temperature == 0`` means greedy; otherwise it must be at least `MIN_TEMPERATURE`. ``seed``
    (from `MIN_SEED` to `MAX_SEED`) makes the request reproducible on its own or amid any others:
    completion ``i`` draws from a generator derived from (seed, prompt, i). ``greedy``,
    ``penalized`` and ``shapes_logits`` are derived from the fields when it is built: to change a
    field, build another (`dataclasses.replace`).
    """

    n: int = field(default=1, metadata=kinds("int"))
    temperature: float = field(default=1.0, metadata=kinds("float"))
    top_p: float = field(default=1.0, metadata=kinds("float"))
    top_k: int = field(default=0, metadata=kinds("int"))  # 0 or -1: disabled
    min_p: float = field(default=0.0, metadata=kinds("float"))
    repetition_penalty: float = field(default=1.0, metadata=kinds("float"))
    presence_penalty: float = field(default=0.0, metadata=kinds("float"))
    frequency_penalty: float = field(default=0.0, metadata=kinds("float"))
    max_tokens: int | None = field(default=16, metadata=kinds("int", "null"))  # None: up to the context
    min_tokens: int = field(default=0, metadata=kinds("int"))
    stop: list[str] | str | None = field(default=None, metadata=kinds("str", "strs", "null"))
    stop_token_ids: list[int] | None = field(default=None, metadata=kinds("ints", "null"))
    include_stop_str_in_output: bool = field(default=False, metadata=kinds("bool"))
    ignore_eos: bool = field(default=False, metadata=kinds("bool"))
    seed: int | None = field(default=None, metadata=kinds("int", "null"))
    # top-k logprobs per generated token (0: the sampled token only)
    logprobs: int | None = field(default=None, metadata=kinds("int", "null"))
    skip_special_tokens: bool = field(default=True, metadata=kinds("bool"))
    # top-k logprobs of every prompt token but the first (0: the token itself), vLLM's meaning
    prompt_logprobs: int | None = field(default=None, metadata=kinds("int", "null"))
    # OpenAI's {token id: bias}, added to these tokens' logits (JSON's string keys become ints)
    logit_bias: dict[int, float] | None = field(default=None, metadata=kinds("object", "null"))
    allowed_token_ids: list[int] | None = field(default=None, metadata=kinds("ints", "null"))
    # words never generated (tokenized with and without a leading space, as vLLM does)
    bad_words: list[str] | None = field(default=None, metadata=kinds("strs", "null"))
    structured_outputs: StructuredOutputsParams | None = field(default=None, metadata=kinds("object", "null"))

    def __post_init__(self) -> None:
        check_kinds(self)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            if not math.isfinite(getattr(self, name)):  # an int or a float below 2**63 (check_kinds)
                raise ParamError(name, f"must be a finite number, not {getattr(self, name)!r}")
        checks = [
            ("n", self.n >= 1, "must be an integer >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            (
                "temperature",
                self.temperature == 0 or self.temperature >= MIN_TEMPERATURE,
                f"must be 0 (greedy) or at least {MIN_TEMPERATURE}",
            ),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be -1, 0 or a positive integer"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens >= 0, "must be >= 0"),
            (
                "min_tokens",
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "must be <= max_tokens",
            ),
            ("stop", all(s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must be non-negative integers"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "must be >= 0"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0, "must be >= 0"),
            (
                "seed",
                self.seed is None or MIN_SEED <= self.seed <= MAX_SEED,
                f"must be an integer from -2**63 to 2**64 - 1, not {self.seed}",
            ),
        ]
        for name, ok, reason in checks:
            if not ok:
                raise ParamError(name, reason)
        for s in self.stop:
            if (why := unicode_error(s)) is not None:
                raise ParamError("stop", f"string {why}")
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.structured_outputs is not None:
            self.structured_outputs = _structured(self.structured_outputs)
        if self.allowed_token_ids is not None or self.bad_words is not None:
            _check_logit_controls(self)
        # derived once here (the engine reads them for every token): whether it draws at random, whether
        # a penalty applies, and whether anything besides temperature and the top-k/top-p/min-p filters
        # changes its logits (else no logits processor is asked about it)
        self.greedy = self.temperature == 0.0
        self.penalized = (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )
        self.shapes_logits = bool(
            self.penalized
            or self.min_tokens
            or self.logit_bias
            or self.allowed_token_ids
            or self.bad_words
            or self.structured_outputs
        )


def _check_logit_controls(p: SamplingParams) -> None:
    """The logit controls' checks that need no model (those against the vocabulary:
    `engine.intake.prepare`); their types are checked with the other fields'."""
    if p.allowed_token_ids is not None:
        p.allowed_token_ids = list(p.allowed_token_ids)
        if not p.allowed_token_ids or not all(t >= 0 for t in p.allowed_token_ids):
            raise ParamError("allowed_token_ids", "must be a non-empty list of non-negative integers")
    if p.bad_words is not None:
        p.bad_words = list(p.bad_words)
        if not all(w.strip() for w in p.bad_words):
            raise ParamError("bad_words", "must be a list of non-blank strings")
        for w in p.bad_words:
            if (why := unicode_error(w)) is not None:
                raise ParamError("bad_words", f"string {why}")


@dataclass
class BeamSearchParams:
    """Beam search settings, with transformers' ``generate(num_beams=...)`` semantics.

    ``length_penalty``: a finished beam's score is ``cumulative_logprob / generated_length **
    length_penalty``. ``early_stopping``: ``True`` stops once ``beam_width`` beams finished;
    ``False`` stops when the best running beam, scored at its current length, cannot beat the
    worst finished one; ``"never"`` scores it at ``max_tokens`` when ``length_penalty > 0``.
    A beam finishes at the model's EOS (unless ``ignore_eos``), at one of ``stop_token_ids``, or
    at ``max_tokens``. A JSONL line asks for beams with ``beam_width`` (the SamplingParams fields
    it shares, ``max_tokens``, ``ignore_eos`` and ``stop_token_ids``, keep their meaning).
    """

    beam_width: int = field(metadata=kinds("int"))
    max_tokens: int = field(default=16, metadata=kinds("int", line=False))
    length_penalty: float = field(default=1.0, metadata=kinds("float"))
    early_stopping: bool | str = field(default=False, metadata=kinds("bool", "str"))
    ignore_eos: bool = field(default=False, metadata=kinds("bool", line=False))
    stop_token_ids: list[int] | None = field(default=None, metadata=kinds("ints", "null", line=False))
    # every beam follows the constraint (a JSONL line gives it as SamplingParams' field)
    structured_outputs: StructuredOutputsParams | None = field(
        default=None, metadata=kinds("object", "null", line=False)
    )

    def __post_init__(self) -> None:
        check_kinds(self)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.structured_outputs is not None:
            self.structured_outputs = _structured(self.structured_outputs)
        checks = [
            ("beam_width", self.beam_width >= 1, "must be an integer >= 1"),
            ("max_tokens", self.max_tokens >= 1, "must be an integer >= 1"),
            ("length_penalty", is_number(self.length_penalty), "must be a finite number"),
            (
                "early_stopping",
                self.early_stopping in (True, False, "never"),
                "must be true, false or 'never'",
            ),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must be non-negative integers"),
        ]
        for name, ok, reason in checks:
            if not ok:
                raise ParamError(name, reason)

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

"""Read a prompts JSONL file as a stream and validate each line into a request (no model needed).

Each non-blank line is one of

* ``{"prompt": "..."}``, ``{"messages": [...]}`` or ``{"prompt_token_ids": [...]}``, with an optional
  ``id`` and per-line sampling fields (``n``, ``max_tokens``, ``temperature``, ...), or
* an OpenAI Batch API request line (``custom_id``, ``method``, ``url``, ``body``).

A line that cannot be used becomes a `LineError` naming its line number and the reason; the other
lines are unaffected. Only problems of the whole file (missing, a directory, empty, not UTF-8)
raise `InputFileError` (found by `scan_input`, a byte-level pass that parses no JSON). Lines are
parsed one at a time (`parse_file`), so memory does not grow with the file: a run keeps only each
line's key. Checks that need the model (tokenization, length, vocabulary) live in `resolve.py`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pagedinfer.openai_params import openai_echo, openai_logit_bias, openai_response_format
from pagedinfer.sampling_params import BeamSearchParams, SamplingParams, is_int, unicode_error
from pagedinfer.seeding import line_seed

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"


class InputFileError(Exception):
    """The input file as a whole is unusable; the message is one line."""


# Per-line sampling fields: name -> accepted JSON types ("int", "float", "bool", "str", "strs", "ints")
# with "null" allowed where the SamplingParams field accepts None.
SAMPLING_FIELDS: dict[str, tuple[str, ...]] = {
    "n": ("int",),
    "max_tokens": ("int", "null"),
    "min_tokens": ("int",),
    "temperature": ("float",),
    "top_p": ("float",),
    "top_k": ("int",),
    "min_p": ("float",),
    "repetition_penalty": ("float",),
    "presence_penalty": ("float",),
    "frequency_penalty": ("float",),
    "seed": ("int", "null"),
    "stop": ("str", "strs", "null"),
    "stop_token_ids": ("ints", "null"),
    "include_stop_str_in_output": ("bool",),
    "ignore_eos": ("bool",),
    "logprobs": ("int", "null"),
    "skip_special_tokens": ("bool",),
    "prompt_logprobs": ("int", "null"),
    "logit_bias": ("object", "null"),
    "allowed_token_ids": ("ints", "null"),
    "bad_words": ("strs", "null"),
    "structured_outputs": ("object", "null"),
}
# Beam search (plain lines): a line with beam_width > 0 (or --beam-width) returns that many beams.
BEAM_FIELDS: dict[str, tuple[str, ...]] = {
    "beam_width": ("int", "null"),
    "length_penalty": ("float",),
    "early_stopping": ("bool", "str"),
}
NOT_FOR_BEAMS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "logprobs",
    "seed",
    "prompt_logprobs",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
)
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
PLAIN_FIELDS = {"id", *PROMPT_FIELDS, *SAMPLING_FIELDS, *BEAM_FIELDS}

OPENAI_LINE_FIELDS = {"custom_id", "method", "url", "body"}
# Body fields OpenAI documents that we honour, plus vLLM's sampling extensions.
OPENAI_BODY_FIELDS = {
    "model",
    "prompt",
    "messages",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "user",
    "stream",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "response_format",
    "logit_bias",
    "echo",
    # vLLM's extensions
    "structured_outputs",
    "allowed_token_ids",
    "bad_words",
    "prompt_logprobs",
}
MESSAGE_FIELDS = {"role", "content", "name"}
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on a chat body's top_logprobs
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how a lone surrogate can enter valid UTF-8 JSON

_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "strs": "a list of strings",
    "ints": "a list of integers",
    "object": "an object",
    "null": "null",
}


@dataclass
class OpenAIRequest:
    """What an OpenAI batch line needs to be answered in kind."""

    custom_id: str
    url: str  # COMPLETIONS_URL or CHAT_URL
    model: str | None
    logprobs_style: str | None = None  # "completions", "chat" or None (not asked)
    echo: bool = False  # completions: the prompt is put before each choice's text (and logprobs)

    @property
    def chat(self) -> bool:
        return self.url == CHAT_URL


@dataclass
class LineRequest:
    """A line that passed every check that needs no model."""

    line: int  # 1-based line number in the file
    key: str  # identity for --resume (see `line_key`)
    id: object  # plain lines: the `id` field or the line number; OpenAI lines: custom_id
    kind: str  # "prompt", "messages" or "token_ids"
    prompt: str | list[dict] | list[int]
    params: SamplingParams | BeamSearchParams
    openai: OpenAIRequest | None = None
    named: bool = False  # a plain line that gave its own id


@dataclass
class LineError:
    """A line that cannot run; written to the output as an error record."""

    line: int
    key: str
    id: object
    reason: str
    openai: OpenAIRequest | None = None  # set when the line was recognisably an OpenAI request
    openai_file: bool = False  # unrecognisable line in a file of OpenAI lines: answer in that shape
    echo: dict = field(default_factory=dict)  # the prompt as given, when it could be read

    @property
    def message(self) -> str:
        return f"line {self.line}: {self.reason}"


Item = LineRequest | LineError


class _Bad(Exception):
    """A line-level problem (internal; becomes a LineError)."""


@dataclass
class InputFile:
    """What a byte-level pass over the input finds: the line count and the kind of file."""

    path: Path
    lines: int  # non-blank lines
    openai: bool  # its first JSON-object line is an OpenAI request: unreadable lines answer in that shape


def scan_input(path: Path) -> InputFile:
    """Check the file as a whole (exists, a file, UTF-8, not empty) without parsing it. Raises InputFileError."""
    if not path.exists():
        raise InputFileError(f"input file {path} does not exist")
    if path.is_dir():
        raise InputFileError(f"input path {path} is a directory; give a .jsonl file")
    count, openai = 0, None
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                text = _decode(path, number, raw)
                if not text.strip():
                    continue
                count += 1
                if openai is None and text.lstrip().startswith("{"):
                    try:
                        obj = json.loads(text)
                    except json.JSONDecodeError:
                        continue
                    openai = _is_openai(obj)
    except OSError as e:
        raise InputFileError(f"cannot read input file {path}: {e.strerror or e}") from None
    if not count:
        raise InputFileError(f"input file {path} is empty: it needs one JSON request per line")
    return InputFile(path, count, bool(openai))


def read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The non-blank lines of ``path`` as (line number, text), read one at a time."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            text = _decode(path, number, raw)
            if text.strip():
                yield number, text


def _decode(path: Path, number: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(
            f"input file {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} on line {number})"
        ) from None


def parse_file(source: InputFile, defaults: dict, base_seed: int = 0) -> Iterator[Item]:
    """Every non-blank line of ``source`` validated, in file order (see `LineParser`)."""
    parser = LineParser(defaults, base_seed, source.openai)
    for number, text in read_lines(source.path):
        yield parser.parse(number, text)


def line_key(custom_id: object, ident: object, line: object) -> str:
    """How --resume recognises a line: its custom_id, else its id; the one function for input and output.

    A line without an ``id`` is named by its line number (``line:N``), so an explicit ``"id": 3``
    elsewhere never collides with it; an explicit id equal to its own line number means the same.
    """
    if custom_id is not None:
        return f"custom_id:{json.dumps(custom_id)}"
    if is_int(ident) and ident == line:
        return f"line:{line}"
    return f"id:{json.dumps(ident)}"


class LineParser:
    """Validates lines one at a time; remembers each key's first line (duplicates; output order)."""

    def __init__(self, defaults: dict, base_seed: int, openai_file: bool) -> None:
        self.defaults = defaults
        self.base_seed = base_seed
        self.openai_file = openai_file
        self.first_line: dict[str, int] = {}  # key -> the line that first used it

    def parse(self, number: int, text: str) -> Item:
        item = _parse_one(number, _load(text), self.defaults, self.base_seed, self.openai_file)
        if not isinstance(item, LineRequest):
            self.first_line.setdefault(item.key, number)
            return item
        keys = [item.key]
        if item.named and is_int(item.id) and item.id == number:
            keys.append(f"id:{json.dumps(item.id)}")  # an explicit id N on line N: both names
        for key in keys:
            first = self.first_line.get(key)
            if first is not None and first != number:
                what = "custom_id" if item.openai else "id"
                return LineError(
                    number,
                    item.key,
                    item.id,
                    f"duplicate {what} {item.id!r} (first used on line {first})",
                    item.openai,
                    item.openai is not None,
                )
        for key in keys:
            self.first_line[key] = number
        return item


def _load(text: str) -> object:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return _Bad(f"not valid JSON ({e.msg} at column {e.colno})")
    if _SURROGATE_ESCAPE.search(text) and (where := _bad_string(obj, "")) is not None:
        return _Bad(where)
    return obj


def _bad_string(value: object, path: str) -> str | None:
    """The first string (key or value) in ``value`` that is not valid Unicode, as '<path> is not...'."""
    if isinstance(value, str):
        why = unicode_error(value)
        return f"{path or 'the line'} {why}" if why else None
    if isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            if (why := unicode_error(k)) is not None:
                return f"a field name in {path or 'the line'} {why}"
            if (found := _bad_string(v, where)) is not None:
                return found
    if isinstance(value, list):
        for i, v in enumerate(value):
            if (found := _bad_string(v, f"{path}[{i}]")) is not None:
                return found
    return None


def _is_openai(obj: dict) -> bool:
    return bool(OPENAI_LINE_FIELDS & obj.keys())


def _parse_one(number: int, obj: object, defaults: dict, base_seed: int, openai_file: bool) -> Item:
    if isinstance(obj, _Bad):
        ident = f"line-{number}" if openai_file else number
        return LineError(number, line_key(None, ident, number), ident, str(obj), None, openai_file)
    if not isinstance(obj, dict):
        ident = f"line-{number}" if openai_file else number
        return LineError(
            number,
            line_key(None, ident, number),
            ident,
            f"a line must be a JSON object, not {_json_type(obj)}",
            None,
            openai_file,
        )
    if _is_openai(obj):
        return _parse_openai(number, obj, defaults, base_seed)
    return _parse_plain(number, obj, defaults, base_seed)


# -- plain lines ----------------------------------------------------------------------------------
def _parse_plain(number: int, obj: dict, defaults: dict, base_seed: int) -> Item:
    ident = obj.get("id", number)
    if not (isinstance(ident, str) and ident) and not is_int(ident):
        return LineError(
            number, line_key(None, number, number), number, "id must be a non-empty string or an integer"
        )
    key = line_key(None, ident, number)
    echo = {k: obj[k] for k in PROMPT_FIELDS if k in obj}
    try:
        _no_unknown(obj, PLAIN_FIELDS, "field")
        kind, prompt = _plain_prompt(obj)
        overrides = {k: _check_field(k, obj[k], SAMPLING_FIELDS[k]) for k in SAMPLING_FIELDS if k in obj}
        beam = {k: _check_field(k, obj[k], BEAM_FIELDS[k]) for k in BEAM_FIELDS if k in obj}
        width = beam.pop("beam_width", defaults.get("beam_width"))
        if width:
            params = _beam_params(width, beam, defaults, overrides)
        else:
            params = _sampling(defaults, overrides, base_seed, key)
    except _Bad as e:
        return LineError(number, key, ident, str(e), None, False, echo)
    return LineRequest(number, key, ident, kind, prompt, params, named="id" in obj)


def _plain_prompt(obj: dict) -> tuple[str, object]:
    given = [k for k in PROMPT_FIELDS if k in obj]
    if not given:
        raise _Bad("no prompt: give 'prompt', 'messages' or 'prompt_token_ids'")
    if len(given) > 1:
        raise _Bad(f"give exactly one of 'prompt', 'messages', 'prompt_token_ids' (got {', '.join(given)})")
    name = given[0]
    if name == "prompt":
        return "prompt", _check_prompt_text(obj["prompt"], "prompt")
    if name == "messages":
        return "messages", _check_messages(obj["messages"])
    return "token_ids", _check_token_ids(obj["prompt_token_ids"], "prompt_token_ids")


# -- OpenAI batch lines ---------------------------------------------------------------------------
def _parse_openai(number: int, obj: dict, defaults: dict, base_seed: int) -> Item:
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        ident = f"line-{number}"
        return LineError(
            number, line_key(None, ident, number), ident, "custom_id must be a non-empty string", None, True
        )
    key = line_key(cid, None, number)
    body = obj.get("body")
    url = obj.get("url")
    info = OpenAIRequest(cid, url if url in (COMPLETIONS_URL, CHAT_URL) else COMPLETIONS_URL, None)
    echo = {k: body[k] for k in ("prompt", "messages") if isinstance(body, dict) and k in body}
    try:
        _no_unknown(obj, OPENAI_LINE_FIELDS, "field")
        if obj.get("method", "POST") != "POST":
            raise _Bad(f"method must be 'POST', not {obj.get('method')!r}")
        if url not in (COMPLETIONS_URL, CHAT_URL):
            raise _Bad(f"url must be {COMPLETIONS_URL!r} or {CHAT_URL!r}, not {url!r}")
        if not isinstance(body, dict):
            raise _Bad(f"body must be a JSON object, not {_json_type(body)}")
        _no_unknown(body, OPENAI_BODY_FIELDS, "body field")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _Bad("body.model must be a string")
        info.model = model
        if body.get("stream", False) is not False:
            raise _Bad("body.stream must be false: batch requests are not streamed")
        if "user" in body and not isinstance(body["user"], str):
            raise _Bad("body.user must be a string")
        kind, prompt = _openai_prompt(body, info.chat)
        overrides, info.logprobs_style = _openai_sampling(body, info.chat)
        info.echo = body.get("echo") is True
        params = _sampling(defaults, overrides, base_seed, key)
    except _Bad as e:
        return LineError(number, key, cid, str(e), info, True, echo)
    return LineRequest(number, key, cid, kind, prompt, params, info)


def _openai_prompt(body: dict, chat: bool) -> tuple[str, object]:
    if chat:
        if "prompt" in body:
            raise _Bad("a chat completions body takes 'messages', not 'prompt'")
        if "messages" not in body:
            raise _Bad("no prompt: a chat completions body needs 'messages'")
        return "messages", _check_messages(body["messages"], "body.messages")
    if "messages" in body:
        raise _Bad("a completions body takes 'prompt', not 'messages' (use /v1/chat/completions)")
    if "prompt" not in body:
        raise _Bad("no prompt: a completions body needs 'prompt'")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a one-element batch of prompts
    if isinstance(prompt, list):
        if prompt and all(isinstance(p, str) for p in prompt):
            raise _Bad("body.prompt holds several prompts; give one prompt per line")
        return "token_ids", _check_token_ids(prompt, "body.prompt")
    return "prompt", _check_prompt_text(prompt, "body.prompt")


def _openai_sampling(body: dict, chat: bool) -> tuple[dict, str | None]:
    names = set(SAMPLING_FIELDS) - {"logprobs", "logit_bias"}
    overrides = {k: _check_field(f"body.{k}", body[k], SAMPLING_FIELDS[k]) for k in names if k in body}
    try:
        if "response_format" in body:
            if "structured_outputs" in body:
                raise ValueError("response_format and structured_outputs cannot both be given")
            overrides.update(openai_response_format(body["response_format"]))
        overrides.update(openai_logit_bias(body.get("logit_bias")))
        if "echo" in body:
            if chat:
                raise ValueError("echo belongs to completions; chat completions do not echo the prompt")
            overrides.update(openai_echo(body["echo"], body.get("logprobs")))
    except ValueError as e:
        raise _Bad(f"body.{e}") from None
    if "max_completion_tokens" in body:
        if "max_tokens" in body:
            raise _Bad("give body.max_tokens or body.max_completion_tokens, not both")
        overrides["max_tokens"] = _check_field(
            "body.max_completion_tokens", body["max_completion_tokens"], ("int", "null")
        )
    style = None
    if chat:
        wanted = _check_field("body.logprobs", body.get("logprobs", False), ("bool", "null"))
        top = _check_field("body.top_logprobs", body.get("top_logprobs"), ("int", "null"))
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise _Bad(f"body.top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, not {top}")
        if top is not None and not wanted:
            raise _Bad("body.top_logprobs needs body.logprobs set to true")
        if wanted:
            overrides["logprobs"], style = top or 0, "chat"
    else:
        if "top_logprobs" in body:
            raise _Bad("body.top_logprobs belongs to chat completions; completions take body.logprobs")
        count = _check_field("body.logprobs", body.get("logprobs"), ("int", "null"))
        if count is not None:
            overrides["logprobs"], style = count, "completions"
    return overrides, style


# -- shared checks --------------------------------------------------------------------------------
def _no_unknown(obj: dict, known: set[str], what: str, prefix: str = "") -> None:
    unknown = sorted(obj.keys() - known)
    if unknown:
        raise _Bad(f"{prefix}unknown {what}{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}")


def _beam_params(width: int, beam: dict, defaults: dict, overrides: dict) -> BeamSearchParams:
    given = [k for k in NOT_FOR_BEAMS if k in overrides]
    if given:
        raise _Bad(f"a beam search line takes no {', '.join(map(repr, given))} (beams are greedy and ranked)")
    max_tokens = overrides.get("max_tokens", defaults.get("max_tokens", 16))
    if max_tokens is None:
        raise _Bad("max_tokens must be an integer for beam search")
    try:
        return BeamSearchParams(
            beam_width=width,
            max_tokens=max_tokens,
            ignore_eos=overrides.get("ignore_eos", False),
            stop_token_ids=overrides.get("stop_token_ids"),
            structured_outputs=overrides.get("structured_outputs"),
            **beam,
        )
    except ValueError as e:
        raise _Bad(str(e)) from None


def _sampling(defaults: dict, overrides: dict, base_seed: int, key: str) -> SamplingParams:
    defaults = {k: v for k, v in defaults.items() if k != "beam_width"}
    values = {**defaults, **overrides}  # null overrides too: max_tokens null = up to the context
    if values.get("seed") is None:
        values["seed"] = line_seed(base_seed, key)
    try:
        return SamplingParams(**values)
    except (ValueError, TypeError) as e:
        raise _Bad(str(e)) from None


def _check_prompt_text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise _Bad(f"{name} must be a string, not {_json_type(value)}")
    return value


def _check_token_ids(value: object, name: str) -> list[int]:
    if not isinstance(value, list) or not all(is_int(t) and t >= 0 for t in value):
        raise _Bad(f"{name} must be a list of non-negative integers")
    if not value:
        raise _Bad(f"{name} is empty")
    return list(value)


def _check_messages(value: object, name: str = "messages") -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _Bad(f"{name} must be a non-empty list of {{'role': ..., 'content': ...}} objects")
    out = []
    for i, msg in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(msg, dict):
            raise _Bad(f"{where} must be an object, not {_json_type(msg)}")
        _no_unknown(msg, MESSAGE_FIELDS, "field", f"{where} has ")
        if not isinstance(msg.get("role"), str) or not msg["role"]:
            raise _Bad(f"{where}.role must be a non-empty string")
        content = msg.get("content")
        if isinstance(content, list):  # OpenAI content parts: only text parts can be served
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise _Bad(f"{where}.content parts must all be {{'type': 'text', 'text': ...}}")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _Bad(f"{where}.content must be a string, not {_json_type(content)}")
        out.append({**msg, "content": content})
    return out


def _check_field(name: str, value: object, kinds: tuple[str, ...]) -> object:
    ok = {
        "int": is_int(value),
        "float": (is_int(value) or isinstance(value, float)),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "strs": isinstance(value, list) and all(isinstance(s, str) for s in value),
        "ints": isinstance(value, list) and all(is_int(t) for t in value),
        "object": isinstance(value, dict),
        "null": value is None,
    }
    if not any(ok[k] for k in kinds):
        want = " or ".join(_TYPE_WORDS[k] for k in kinds)
        raise _Bad(f"{name} must be {want}, not {_json_type(value)}")
    return value


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__

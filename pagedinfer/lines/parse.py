"""One JSONL line -> a `LineRequest` (every check that needs no model) or a `LineError` naming the field.

Each non-blank line is one of

* ``{"prompt": "..."}``, ``{"messages": [...]}`` or ``{"prompt_token_ids": [...]}``, with an optional
  ``id``, an optional ``lora`` (the name of a ``--lora`` adapter) and any `SamplingParams` field by
  its own name (``n``, ``max_tokens``, ``temperature``...), or ``beam_width`` (with ``length_penalty``,
  ``early_stopping``) for beam search, or
* an OpenAI Batch API request line (``custom_id``, ``method``, ``url``, ``body``); the body takes
  OpenAI's fields and, as vLLM's server does, any `SamplingParams` field; a ``body.model`` that names
  a ``--lora`` adapter runs with it (resolved where the adapters are known, `LineRequest.adapter`).

JSON is parsed with limits (integers of at most 4300 digits, finite floats, no NaN, nesting at
most `MAX_DEPTH` deep; `SamplingParams` then bounds every integer to 64 bits), so no value of a line, however hostile, can do more than fail
that line. Lines without ``max_tokens`` generate up to 16 tokens (vLLM's offline default), except
chat and OpenAI lines, which, as OpenAI and vLLM's server do, generate up to the end of the context.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

from pagedinfer.lines.line import (
    CHAT_URL,
    COMPLETIONS_URL,
    LineError,
    LineRequest,
    OpenAIRequest,
    line_key,
)
from pagedinfer.lines.openai_params import openai_echo, openai_response_format
from pagedinfer.lines.source import InputLines, LineDecodeError
from pagedinfer.sampling_params import (
    BeamSearchParams,
    ParamError,
    SamplingParams,
    describe,
    is_int,
    line_fields,
    unicode_error,
)
from pagedinfer.seeding import line_seed

MAX_DEPTH = 64  # nesting of arrays and objects in one line
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on a chat body's top_logprobs

SAMPLING_FIELDS = line_fields(SamplingParams)
BEAM_FIELDS = line_fields(BeamSearchParams)
# SamplingParams fields a beam line keeps
BEAM_SHARED = ("max_tokens", "ignore_eos", "stop_token_ids", "structured_outputs")
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
PLAIN_FIELDS = {"id", "lora", *PROMPT_FIELDS, *SAMPLING_FIELDS, *BEAM_FIELDS}
OPENAI_LINE_FIELDS = {"custom_id", "method", "url", "body"}
# Body fields of OpenAI's own that are not SamplingParams fields (logprobs means something else there)
OPENAI_BODY_FIELDS = {
    "model",
    "prompt",
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "user",
    "stream",
    "response_format",  # -> structured_outputs
    "echo",  # completions: with logprobs -> prompt_logprobs
}
MESSAGE_FIELDS = {"role", "content", "name"}
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how a lone surrogate can enter valid UTF-8 JSON


class _Bad(Exception):
    """A line-level problem (internal; becomes a LineError)."""


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Bad(f"not valid JSON (the number {text[:20]}{'…' if len(text) > 20 else ''} is out of range)")
    return value


def _no_constant(name: str) -> None:
    raise _Bad(f"not valid JSON ({name} is not a JSON number)")


def load_json(text: str) -> object:
    """``text`` parsed within the limits; raises `_Bad` with the reason."""
    text = text.rstrip("\r\n")
    try:
        obj = json.loads(text, parse_float=_parse_float, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        where = "at the end of the line" if e.pos >= len(text) else f"at character {e.pos + 1} of {len(text)}"
        raise _Bad(f"not valid JSON ({e.msg} {where})") from None
    except RecursionError:
        raise _Bad(f"not valid JSON: nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as e:  # an integer of more than 4300 digits (Python's own limit)
        raise _Bad(f"not valid JSON: {str(e).split(':')[0].lower()}") from None
    if (text.count("[") + text.count("{") > MAX_DEPTH) and _too_deep(obj):
        raise _Bad(f"nested more than {MAX_DEPTH} levels deep")
    if _SURROGATE_ESCAPE.search(text) and (where := _bad_string(obj, "")) is not None:
        raise _Bad(where)
    return obj


def _too_deep(obj: object) -> bool:
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (list, dict)):
            if depth > MAX_DEPTH:
                return True
            stack += [(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)]
    return False


def _bad_string(value: object, path: str) -> str | None:
    """The first string (key or value) in ``value`` that is not valid Unicode, as '<path> is not...'."""
    if isinstance(value, str):
        why = unicode_error(value)
        return f"{path or 'the line'} {why}" if why else None
    if isinstance(value, dict):
        for k, v in value.items():
            if (why := unicode_error(k)) is not None:
                return f"a field name in {path or 'the line'} {why}"
            if (found := _bad_string(v, f"{path}.{k}" if path else str(k))) is not None:
                return found
    if isinstance(value, list):
        for i, v in enumerate(value):
            if (found := _bad_string(v, f"{path}[{i}]")) is not None:
                return found
    return None


@dataclass
class LineParser:
    """Validates lines one at a time with the run's defaults; remembers the line of each id (duplicates,
    output order). ``openai_file``: answer lines that are not even requests in the OpenAI shape
    (None: as the file's first JSON object line is, an OpenAI request or not). ``adapters``: the
    names of the run's LoRA adapters, which an OpenAI body's ``model`` may name (vLLM's convention)."""

    defaults: dict  # SamplingParams (and beam_width) values a line does not set
    base_seed: int = 0
    openai_file: bool | None = False
    adapters: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.first_line: dict[str, int] = {}  # key -> the line that holds it

    def parse(self, number: int, text: str | LineDecodeError) -> LineRequest | LineError:
        try:
            obj = _Bad(f"the line {text}") if isinstance(text, LineDecodeError) else load_json(text)
        except _Bad as e:
            obj = e
        if isinstance(obj, _Bad):
            item = self._unnamed(number, str(obj))
        elif not isinstance(obj, dict):
            item = self._unnamed(number, f"a line must be a JSON object, not {describe(obj)}")
        else:
            openai = bool(OPENAI_LINE_FIELDS & obj.keys())
            if self.openai_file is None:  # the first JSON object decides how unreadable lines are answered
                self.openai_file = openai
            item = self._openai(number, obj) if openai else self._plain(number, obj)
        keys = [item.key]
        if isinstance(obj, dict) and obj.get("id") == number and is_int(obj["id"]) and item.openai is None:
            keys.append(f"id:{number}")  # "id": N on line N is named both ways: no other line may take N
        taken = [self.first_line[k] for k in keys if self.first_line.get(k, number) != number]
        if taken:  # an id an earlier line uses: this line is named by its number
            what = "custom_id" if item.openai else "id"
            item = self._unnamed(
                number, f"duplicate {what} {item.id!r} (first used on line {taken[0]})", item
            )
            keys = [item.key]
        for k in keys:
            self.first_line[k] = number
        return item

    def _unnamed(self, number: int, reason: str, item: LineRequest | LineError | None = None) -> LineError:
        """The error record of a line no id can name: keyed by its line number, in its own position."""
        openai = getattr(item, "openai", None)
        if openai is not None:
            openai = OpenAIRequest(None, openai.url)
        echo = getattr(item, "echo", None) or (
            {} if item is None or item.kind != "prompt" else dict(item.prompt)
        )
        shape = bool(self.openai_file) or openai is not None
        return LineError(number, line_key(None, None, number), number, reason, openai, shape, echo)

    # -- plain lines ----------------------------------------------------------------------------
    def _plain(self, number: int, obj: dict) -> LineRequest | LineError:
        ident = obj.get("id", number)
        if not (isinstance(ident, str) and ident) and not is_int(ident):
            return self._unnamed(
                number, f"id must be a non-empty string or an integer, not {describe(ident)}"
            )
        key = line_key(None, ident, number)
        echo = {k: obj[k] for k in PROMPT_FIELDS if k in obj}
        try:
            if unknown := obj.keys() - PLAIN_FIELDS:
                raise _unknown(unknown, "field")
            lora = obj.get("lora")
            if lora is not None and not (isinstance(lora, str) and lora):
                raise _Bad(f"lora must be an adapter's name (a non-empty string), not {describe(lora)}")
            given = [k for k in PROMPT_FIELDS if k in obj]
            if not given:
                raise _Bad("no prompt: give 'prompt', 'messages' or 'prompt_token_ids'")
            if len(given) > 1:
                raise _Bad(
                    f"give exactly one of 'prompt', 'messages', 'prompt_token_ids' (got {', '.join(given)})"
                )
            chat = given[0] == "messages"
            prompt = {given[0]: _PROMPT_CHECKS[given[0]](obj[given[0]], given[0])}
            width = obj.get("beam_width", self.defaults.get("beam_width"))
            if width is not None and width != 0:
                params = self._beam(obj)
            else:
                if stray := sorted(k for k in BEAM_FIELDS if k in obj and k != "beam_width"):
                    raise _Bad(
                        f"{', '.join(map(repr, stray))} belong{'s' * (len(stray) == 1)} to beam search: set beam_width"
                    )
                params = self._sampling({k: obj[k] for k in SAMPLING_FIELDS if k in obj}, chat, key, "")
        except _Bad as e:
            return LineError(number, key, ident, str(e), None, False, echo)
        return LineRequest(number, key, ident, prompt, params, lora=lora)

    def _beam(self, obj: dict) -> BeamSearchParams:
        other = sorted(k for k in obj if k in SAMPLING_FIELDS and k not in BEAM_SHARED)
        if other:
            raise _Bad(
                f"a beam search line takes no {', '.join(map(repr, other))} (beams are greedy and ranked)"
            )
        values = {k: obj[k] for k in (*BEAM_FIELDS, *BEAM_SHARED) if k in obj}
        values.setdefault("beam_width", self.defaults.get("beam_width"))
        if "max_tokens" in self.defaults:
            values.setdefault("max_tokens", self.defaults["max_tokens"])
        if values.get("max_tokens", 0) is None:
            raise _Bad("max_tokens must be an integer for beam search")
        try:
            return BeamSearchParams(**values)
        except ParamError as e:
            raise _Bad(str(e)) from None

    def _sampling(self, given: dict, unbounded: bool, key: str, prefix: str) -> SamplingParams:
        """SamplingParams from the run's defaults and the line's ``given`` fields (named ``prefix + name``)."""
        values = {k: v for k, v in self.defaults.items() if k in SAMPLING_FIELDS}
        if unbounded:  # chat and OpenAI lines: up to the end of the context unless a limit is given
            values.setdefault("max_tokens", None)
        values.update(given)
        if values.get("seed") is None:
            values["seed"] = line_seed(self.base_seed, key)
        try:
            return SamplingParams(**{k: v for k, v in values.items() if k in SAMPLING_FIELDS})
        except ParamError as e:
            raise _Bad(f"{prefix if e.field.split('.')[0] in given else ''}{e}") from None

    # -- OpenAI batch lines ---------------------------------------------------------------------
    def _openai(self, number: int, obj: dict) -> LineRequest | LineError:
        cid, body, url = obj.get("custom_id"), obj.get("body"), obj.get("url")
        info = OpenAIRequest(cid, url if url in (COMPLETIONS_URL, CHAT_URL) else COMPLETIONS_URL)
        if not isinstance(cid, str) or not cid:
            info.custom_id = None
            reason = f"custom_id must be a non-empty string, not {describe(cid)}"
            return LineError(number, line_key(None, None, number), number, reason, info, True)
        key = line_key(cid, None, number)
        echo = {k: body[k] for k in ("prompt", "messages") if isinstance(body, dict) and k in body}
        try:
            if unknown := obj.keys() - OPENAI_LINE_FIELDS:
                raise _unknown(unknown, "field")
            if obj.get("method", "POST") != "POST":
                raise _Bad(f"method must be 'POST', not {obj.get('method')!r}")
            if url not in (COMPLETIONS_URL, CHAT_URL):
                raise _Bad(f"url must be {COMPLETIONS_URL!r} or {CHAT_URL!r}, not {url!r}")
            if not isinstance(body, dict):
                raise _Bad(f"body must be a JSON object, not {describe(body)}")
            if unknown := body.keys() - OPENAI_BODY_FIELDS - SAMPLING_FIELDS.keys():
                raise _unknown(unknown, "body field")
            model = body.get("model")
            if model is not None and not isinstance(model, str):
                raise _Bad(f"body.model must be a string, not {describe(model)}")
            info.model = model
            if body.get("stream", False) is not False:
                raise _Bad("body.stream must be false: batch requests are not streamed")
            if "user" in body and not isinstance(body["user"], str):
                raise _Bad(f"body.user must be a string, not {describe(body['user'])}")
            prompt = _openai_prompt(body, info.chat)
            given, info.logprobs_style = _openai_sampling(body, info.chat)
            info.echo = body.get("echo") is True
            info.prompt_logprobs = body.get("prompt_logprobs") is not None
            params = self._sampling(given, True, key, "body.")
        except _Bad as e:
            return LineError(number, key, cid, str(e), info, True, echo)
        lora = info.model if info.model in self.adapters else None
        return LineRequest(number, key, cid, prompt, params, info, lora)


def parse_lines(
    source: InputLines, defaults: dict, base_seed: int = 0, adapters: frozenset[str] = frozenset()
) -> Iterator[LineRequest | LineError]:
    """Every non-blank line of ``source`` parsed, in file order (one parser: duplicates are found)."""
    parser = LineParser(defaults, base_seed, openai_file=None, adapters=adapters)
    for number, text in source:
        yield parser.parse(number, text)


def _openai_prompt(body: dict, chat: bool) -> dict:
    if chat:
        if "prompt" in body:
            raise _Bad("a chat completions body takes 'messages', not 'prompt'")
        if "messages" not in body:
            raise _Bad("no prompt: a chat completions body needs 'messages'")
        return {"messages": _check_messages(body["messages"], "body.messages")}
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
        return {"prompt_token_ids": _check_token_ids(prompt, "body.prompt")}
    return {"prompt": _check_prompt_text(prompt, "body.prompt")}


def _openai_sampling(body: dict, chat: bool) -> tuple[dict, str | None]:
    """The body's SamplingParams fields (OpenAI's names mapped), and how logprobs are to be answered."""
    given = {k: body[k] for k in SAMPLING_FIELDS if k in body and k != "logprobs"}
    try:
        if "response_format" in body:
            if "structured_outputs" in body:
                raise ValueError("response_format and structured_outputs cannot both be given")
            given.update(openai_response_format(body["response_format"]))
        if "echo" in body:
            if chat:
                raise ValueError("echo belongs to completions; chat completions do not echo the prompt")
            given.update(openai_echo(body["echo"], body.get("logprobs")))
    except ValueError as e:
        raise _Bad(f"body.{e}") from None
    if "max_completion_tokens" in body:
        if "max_tokens" in body:
            raise _Bad("give body.max_tokens or body.max_completion_tokens, not both")
        given["max_tokens"] = body["max_completion_tokens"]
    if chat:
        wanted, top = body.get("logprobs", False), body.get("top_logprobs")
        if not isinstance(wanted, bool) and wanted is not None:
            raise _Bad(f"body.logprobs must be true or false, not {describe(wanted)}")
        if top is not None and not (is_int(top) and 0 <= top <= MAX_TOP_LOGPROBS):
            raise _Bad(
                f"body.top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, not {describe(top)}"
            )
        if top is not None and not wanted:
            raise _Bad("body.top_logprobs needs body.logprobs set to true")
        if wanted:
            given["logprobs"] = top or 0
            return given, "chat"
        return given, None
    if "top_logprobs" in body:
        raise _Bad("body.top_logprobs belongs to chat completions; completions take body.logprobs")
    if body.get("logprobs") is not None:
        given["logprobs"] = body["logprobs"]
        return given, "completions"
    return given, None


def _unknown(names: set[str], what: str, prefix: str = "") -> _Bad:
    """The error naming fields a line may not have (sorted, so the message does not vary)."""
    s = "s" if len(names) > 1 else ""
    return _Bad(f"{prefix}unknown {what}{s} {', '.join(map(repr, sorted(names)))}")


def _check_prompt_text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise _Bad(f"{name} must be a string, not {describe(value)}")
    return value


def _check_token_ids(value: object, name: str) -> list[int]:
    if not isinstance(value, list) or not all(is_int(t) and t >= 0 for t in value):
        raise _Bad(f"{name} must be a list of non-negative integers")
    if not value:
        raise _Bad(f"{name} is empty")
    return list(value)


def _check_messages(value: object, name: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _Bad(f"{name} must be a non-empty list of {{'role': ..., 'content': ...}} objects")
    out = []
    for i, msg in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(msg, dict):
            raise _Bad(f"{where} must be an object, not {describe(msg)}")
        if unknown := msg.keys() - MESSAGE_FIELDS:
            raise _unknown(unknown, "field", f"{where} has ")
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
            raise _Bad(f"{where}.content must be a string, not {describe(content)}")
        out.append({**msg, "content": content})
    return out


_PROMPT_CHECKS = {
    "prompt": _check_prompt_text,
    "messages": _check_messages,
    "prompt_token_ids": _check_token_ids,
}

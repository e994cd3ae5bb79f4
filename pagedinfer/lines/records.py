"""Output records: one JSON object per input line, in the shape its input line asked for.

Plain lines get ``{"id", "line", "prompt"..., "outputs", "usage", "error": null}``; OpenAI batch
lines get OpenAI batch output lines (``id``, ``custom_id``, ``response``, ``error``) with a
completions or chat-completions body. A line that failed gets an error record naming its line; one
that no custom_id can name (in an OpenAI file) carries ``"custom_id": null`` and its ``line``.
`record_key` reads back the key (`line.line_key`) of the line a record answers.
"""

from __future__ import annotations

import hashlib
import time

from pagedinfer.lines.line import LineError, LineRequest, OpenAIRequest, line_key
from pagedinfer.outputs import BeamSearchOutput, CompletionOutput, RequestOutput
from pagedinfer.sampling_params import is_int


class TokenText:
    """Per-token text (and bytes) for logprobs, cached; works without a tokenizer too."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_map: dict[str, int] | None = None
        if tokenizer is not None and type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel":
            self._byte_map = {c: b for b, c in _bytes_to_unicode().items()}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            if self._tok is None:
                text = f"<{token_id}>"
                raw = list(text.encode())
            else:
                text = self._tok.decode([token_id], skip_special_tokens=False)
                piece = self._tok.convert_ids_to_tokens(token_id)
                if self._byte_map is not None and piece and all(c in self._byte_map for c in piece):
                    raw = [self._byte_map[c] for c in piece]  # exact bytes, even of half a character
                else:
                    raw = list(text.encode())
            self._cache[token_id] = (text, raw)
        return self._cache[token_id]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character byte-level BPE shows it."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def success_record(
    line: LineRequest, out: RequestOutput | BeamSearchOutput, token_text: TokenText, model: str
) -> dict:
    """``model``: the run's model name, for OpenAI lines whose body names none (a body's is echoed)."""
    beams = isinstance(out, BeamSearchOutput)
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in (out.sequences if beams else out.outputs))
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    k = 0 if beams else line.params.logprobs or 0
    if line.openai is not None:
        return _openai_success(
            line.openai, out, usage, k, line.params.prompt_logprobs or 0, token_text, model
        )
    # a plain line's id, line number and prompt, as its input gave it (a chat line: and the rendered text)
    record = {"id": line.id, "line": line.line, **line.prompt}
    if "messages" in line.prompt:
        record["prompt"] = out.prompt
    if beams:
        record["beams"] = [_beam(i, s) for i, s in enumerate(out.sequences)]
        return {**record, "usage": usage, "error": None}
    if out.prompt_logprobs is not None:  # per prompt token (the first has none), top prompt_logprobs
        kp = line.params.prompt_logprobs
        record["prompt_logprobs"] = [
            None if top is None else _plain_logprobs(tid, top, kp, token_text)
            for tid, top in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True)
        ]
    outputs = []
    for c in out.outputs:
        entry = {
            "index": c.index,
            "text": c.text,
            "token_ids": list(c.token_ids),
            "finish_reason": c.finish_reason,
        }
        if c.stop_reason is not None:
            entry["stop_reason"] = c.stop_reason
        if c.capped_by is not None:
            entry["capped_by"] = c.capped_by
        if c.logprobs is not None:
            entry["cumulative_logprob"] = c.cumulative_logprob
            entry["logprobs"] = [
                _plain_logprobs(tid, top, k, token_text)
                for tid, top in zip(c.token_ids, c.logprobs, strict=False)
            ]
        outputs.append(entry)
    return {**record, "outputs": outputs, "usage": usage, "error": None}


def _beam(index: int, s) -> dict:
    return {
        "index": index,
        "text": s.text,
        "token_ids": s.token_ids,
        "cumulative_logprob": s.cumulative_logprob,
        "score": s.score,
        "finish_reason": s.finish_reason,
    } | ({"capped_by": s.capped_by} if s.capped_by is not None else {})


def error_record(err: LineError) -> dict:
    if err.openai is not None and err.openai.custom_id is not None:
        rid = _rid(err.openai.custom_id)
        return {
            "id": f"batch_req_{rid}",
            "custom_id": err.openai.custom_id,
            "response": {
                "status_code": 400,
                "request_id": f"req_{rid}",
                "body": {
                    "error": {
                        "message": err.message,
                        "type": "invalid_request_error",
                        "param": None,
                        "code": None,
                    }
                },
            },
            "error": {"code": "invalid_request", "message": err.message},
        }
    if err.openai_file:  # no custom_id can name it: answered by its line
        return {
            "id": f"line-{err.line}",
            "custom_id": None,
            "line": err.line,
            "response": None,
            "error": {"code": "invalid_request", "message": err.message},
        }
    echo = {k: bounded(v) for k, v in err.echo.items()}
    return {"id": err.id, "line": err.line, **echo, "error": err.message}


def record_key(record: object) -> str | None:
    """The key (`line.line_key`) of the input line this output record answers; None if it is not a record."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("custom_id"), str):
        return line_key(record["custom_id"], None, None)
    line = record.get("line") if is_int(record.get("line")) else None
    if "custom_id" in record:  # OpenAI shape without a custom_id: named by its line
        return line_key(None, None, line) if line is not None else None
    return line_key(None, record["id"], line) if "id" in record else None


def caps_of(record: dict) -> set[str]:
    """The per-run caps (``capped_by``) that ended completions of a success record, any shape."""
    body = (record.get("response") or {}).get("body") or {}
    entries = record.get("outputs") or record.get("beams") or body.get("choices") or []
    return {e["capped_by"] for e in entries if "capped_by" in e}


ECHO_CHARS = 1000  # an error record echoes at most this much of a prompt string
ECHO_ITEMS = 100  # ... and of a list (token ids, messages)


def bounded(value: object) -> object:
    """``value`` cut to a bounded size, so a huge bad line never makes a huge error record."""
    if isinstance(value, str) and len(value) > ECHO_CHARS:
        return f"{value[:ECHO_CHARS]}… ({len(value) - ECHO_CHARS:,} more characters)"
    if isinstance(value, list):
        return [bounded(v) for v in value[:ECHO_ITEMS]] + (["…"] if len(value) > ECHO_ITEMS else [])
    if isinstance(value, dict):
        return {k: bounded(v) for k, v in list(value.items())[:ECHO_ITEMS]}
    return value


# -- plain --------------------------------------------------------------------------------------------
def _plain_logprobs(token_id: int, top: dict, k: int, token_text: TokenText) -> dict:
    chosen = top[token_id]
    return {
        "token_id": token_id,
        "token": token_text(token_id)[0],
        "logprob": chosen.logprob,
        "rank": chosen.rank,
        "top_logprobs": [
            {"token_id": tid, "token": token_text(tid)[0], "logprob": lp.logprob, "rank": lp.rank}
            for tid, lp in _top_k(top, k)
        ],
    }


def _top_k(top: dict, k: int) -> list:
    """The k most likely tokens of one step (the sampled token is listed only if it is among them)."""
    return sorted(((tid, lp) for tid, lp in top.items() if lp.rank <= k), key=lambda x: x[1].rank)


# -- OpenAI -------------------------------------------------------------------------------------------
def _rid(custom_id: str) -> str:
    return hashlib.sha256(custom_id.encode()).hexdigest()[:24]


def _openai_success(
    info: OpenAIRequest,
    out: RequestOutput,
    usage: dict,
    k: int,
    k_prompt: int,
    token_text: TokenText,
    model: str,
) -> dict:
    """``k``, ``k_prompt``: how many top logprobs to give per generated token and per prompt token."""
    rid = _rid(info.custom_id)
    prompt_logprobs = _vllm_prompt_logprobs(out, k_prompt, token_text) if info.prompt_logprobs else None
    choices = []
    for c in out.outputs:
        choice: dict = {"index": c.index}
        if info.chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = (out.prompt or "") + c.text if info.echo else c.text
        choice["logprobs"] = _openai_logprobs(c, info, k, token_text, _echoed(info, out))
        choice["finish_reason"] = c.finish_reason
        if c.capped_by is not None:  # an extension, as vLLM's stop_reason is
            choice["capped_by"] = c.capped_by
        if prompt_logprobs is not None and not info.chat:  # vLLM: on each completions choice
            choice["prompt_logprobs"] = prompt_logprobs
        choices.append(choice)
    body = {
        "id": f"{'chatcmpl' if info.chat else 'cmpl'}-{rid}",
        "object": "chat.completion" if info.chat else "text_completion",
        "created": int(time.time()),
        "model": info.model or model,
        "choices": choices,
        "usage": usage,
    }
    if prompt_logprobs is not None and info.chat:  # vLLM: on the chat completion itself
        body["prompt_logprobs"] = prompt_logprobs
    return {
        "id": f"batch_req_{rid}",
        "custom_id": info.custom_id,
        "response": {"status_code": 200, "request_id": f"req_{rid}", "body": body},
        "error": None,
    }


def _vllm_prompt_logprobs(out: RequestOutput, k: int, token_text: TokenText) -> list | None:
    """A body's ``prompt_logprobs`` in vLLM's server shape: per prompt token, null for the first, else
    ``{"token id": {"logprob", "rank", "decoded_token"}}`` for the token itself and the top k."""
    if out.prompt_logprobs is None:
        return None
    return [
        None
        if top is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": token_text(t)[0]}
            for t, lp in top.items()
            if t == tid or lp.rank <= k
        }
        for tid, top in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True)
    ]


def _echoed(info: OpenAIRequest, out: RequestOutput) -> list[tuple[int, dict | None]]:
    """The prompt's (token, logprobs entry) steps a completions ``echo`` puts before each choice's."""
    if not info.echo or out.prompt_logprobs is None:
        return []
    return list(zip(out.prompt_token_ids, out.prompt_logprobs, strict=True))


def _openai_logprobs(
    c: CompletionOutput, info: OpenAIRequest, k: int, token_text: TokenText, echoed: list
) -> dict | None:
    if c.logprobs is None or info.logprobs_style is None:
        return None
    steps = echoed + list(zip(c.token_ids, c.logprobs, strict=False))
    if info.logprobs_style == "chat":
        content = []
        for tid, top in steps:
            text, raw = token_text(tid)
            content.append(
                {
                    "token": text,
                    "logprob": top[tid].logprob,
                    "bytes": raw,
                    "top_logprobs": [
                        {"token": token_text(t)[0], "logprob": lp.logprob, "bytes": token_text(t)[1]}
                        for t, lp in _top_k(top, k)
                    ],
                }
            )
        return {"content": content}
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for tid, top in steps:
        text = token_text(tid)[0]
        tokens.append(text)
        token_logprobs.append(None if top is None else top[tid].logprob)  # the prompt's first token: null
        top_logprobs.append(
            None if top is None else {token_text(t)[0]: lp.logprob for t, lp in _top_k(top, k)}
        )
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }

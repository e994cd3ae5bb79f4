"""The checks that need the loaded model: tokenize a validated line and make sure it can ever run.

A chat line is rendered with the tokenizer's chat template (generation prompt added) and tokenized
without adding special tokens again (the template already holds them). A line whose prompt is too
long for the model's context (a huge text is refused before tokenizing), whose sampling values
exceed the model (``logprobs`` above the vocabulary), or whose worst case needs more KV blocks than
the pool has, becomes a `LineError` here, before anything is generated for it. Any exception while
tokenizing one line fails that line alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedinfer.cli.jsonl_input import LineError, LineRequest


@dataclass
class Resolved:
    item: LineRequest
    text: str | None  # the prompt text (a chat line: the rendered template), None for token ids
    token_ids: list[int]

    @property
    def engine_prompt(self) -> dict:
        return {"prompt_token_ids": self.token_ids, "prompt": self.text}


def resolve(item: LineRequest, engine) -> Resolved | LineError:
    """Tokenize ``item`` with ``engine``'s tokenizer and check it fits the model and the pool."""
    try:
        text, ids = _tokenize(item, engine)
        reason = engine.params_error(item.params) or engine.request_error(ids, item.params)
    except ValueError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        text, ids = None, []
    except Exception as e:  # noqa: BLE001 - a tokenizer failing on one line must not end the run
        reason = f"tokenizing failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        text, ids = None, []
    if reason:
        echo = {"prompt": item.prompt} if item.kind == "prompt" else {}
        return LineError(item.line, item.key, item.id, reason, item.openai, item.openai is not None, echo)
    return Resolved(item, text, ids)


def _tokenize(item: LineRequest, engine) -> tuple[str | None, list[int]]:
    if item.kind == "token_ids":
        return engine.tokenize({"prompt_token_ids": item.prompt})
    if item.kind == "prompt":
        return engine.tokenize(item.prompt)
    tok = engine.loaded.tokenizer
    if tok is None:
        raise ValueError(f"model {engine.loaded.name} has no tokenizer, so chat messages cannot be rendered")
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer of model {engine.loaded.name} has no chat template")
    try:
        text = tok.apply_chat_template(item.prompt, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - template errors (e.g. an unsupported role) are the line's fault
        raise ValueError(
            f"the chat template rejected the messages: {str(e).splitlines()[0] if str(e) else e!r}"
        ) from None
    engine.check_text_length(text)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return engine.tokenize({"prompt_token_ids": ids, "prompt": text})

"""Chat messages made into what a chat template sees, as transformers' ``apply_chat_template`` makes them.

The same three steps as transformers' ``chat_template_utils`` (``_normalize_chat_messages``,
``_plain_template_data``, ``_alias_reasoning_fields``), kept here so that rendering a chat does not
import transformers (most of a second of a run's start-up). tests/test_chat_render.py compares them
with transformers' own on the same messages.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

# the names a message's reasoning is passed under; the first is the one chat templates read
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def template_chat(messages: Any) -> list:
    """``messages`` as the template sees them: message objects made dicts, keys whose value is None
    dropped, everything rebuilt of plain JSON types, reasoning under each of its names. Raises
    TypeError for a message that is not a dict (transformers' words)."""
    return alias_reasoning_fields(plain_template_data(normalize_chat_messages(messages)))


def normalize_chat_messages(conversation: Any) -> list[dict]:
    """Each message a dict (dataclasses and pydantic models converted), without its None values."""
    messages = _message_objects_to_dicts(getattr(conversation, "messages", conversation))
    normalized = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(
                f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}."
            )
        normalized.append({key: value for key, value in message.items() if value is not None})
    return normalized


def _message_objects_to_dicts(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _message_objects_to_dicts(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_message_objects_to_dicts(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_message_objects_to_dicts(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _message_objects_to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _message_objects_to_dicts(value.model_dump())
    return value


def plain_template_data(value: Any) -> Any:
    """``value`` rebuilt of plain JSON types (subclasses stripped to their base type); anything else
    becomes an inert placeholder naming its type ("<ndarray>"), so the sandbox sees no foreign method."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_template_data(key): plain_template_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_template_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_template_data(item) for item in value)
    np = sys.modules.get("numpy")  # a numpy scalar exists only once numpy is imported
    if np is not None and isinstance(value, np.generic):
        return plain_template_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_template_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


def alias_reasoning_fields(chat: list) -> list:
    """Each message's reasoning (under any of `REASONING_FIELDS`) also as ``reasoning_content`` and
    ``thinking`` (gpt-oss templates read the latter)."""
    aliased = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased

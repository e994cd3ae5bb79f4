"""An exception as a user sees it: one line of its message (the rest is a report's detail)."""

from __future__ import annotations


def first_line(error: object, empty: str | None = None) -> str:
    """The first line of ``error``'s message (stripped around); for an empty message ``empty``, or
    else the error's type name."""
    text = str(error).strip()
    if not text:
        return type(error).__name__ if empty is None else empty
    return text.splitlines()[0]


def one_line(e: BaseException) -> str:
    """An exception's message on one line: its first line, and the next one when the first only
    introduces it (huggingface_hub's "Class validation error for validator ...:" then the reason)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def last_line(error: object) -> str:
    """The last line of ``error``'s message (where a wrapped error, a remote one, says its own), or
    the error's type name for an empty message."""
    text = str(error).strip()
    return text.splitlines()[-1] if text else type(error).__name__

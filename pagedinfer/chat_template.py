"""A chat template given by the user (``--chat-template FILE``, ``LLM(chat_template=...)``), checked once.

The template replaces the tokenizer's own; it is compiled here (in the process that will render it:
`chat_render`) before the model loads, so that a template that cannot compile is one line naming the
file and the line, not an error on every chat line.
"""

from __future__ import annotations

from pathlib import Path

from pagedinfer.chat_render import ChatRenderError, compile_error


class ChatTemplateError(ValueError):
    """The template cannot be used; the message is one line naming the file (or the text) and why."""


def read_chat_template(path: Path) -> str:
    """The template text of ``path``, refused (`ChatTemplateError`) when it is missing, not UTF-8
    text, empty, or not a valid Jinja template."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ChatTemplateError(f"chat template {path} does not exist") from None
    except IsADirectoryError:
        raise ChatTemplateError(f"chat template {path} is a directory, not a Jinja file") from None
    except UnicodeDecodeError as e:
        raise ChatTemplateError(f"chat template {path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ChatTemplateError(f"cannot read chat template {path}: {e.strerror}") from None
    if not text.strip():
        raise ChatTemplateError(f"chat template {path} is empty")
    try:
        error = compile_error(text)
    except ChatRenderError as e:
        raise ChatTemplateError(f"chat template {path}: {e}") from None
    if error is not None:
        raise ChatTemplateError(f"chat template {path} {error}")
    return text

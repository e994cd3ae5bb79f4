"""A chat template given by the user (``--chat-template FILE``, ``LLM(chat_template=...)``), checked once.

The template replaces the tokenizer's own; it is compiled here only to find syntax errors before
the model loads (one line naming the file and the line), not to render: rendering stays with the
tokenizer (``apply_chat_template``), which compiles it with the same extensions.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension


class ChatTemplateError(ValueError):
    """The template cannot be used; the message is one line naming the file (or the text) and why."""


class _Generation(Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` block (it marks assistant tokens), parsed
    as a plain block so that a template using it compiles here as it does in the tokenizer."""

    tags = {"generation"}

    def parse(self, parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def template_error(text: str) -> str | None:
    """Why ``text`` does not compile as a chat template ("line 3: unexpected '}'"), or None."""
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _Generation])
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as e:
        return f"line {e.lineno}: {e.message}"
    return None


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
    error = template_error(text)
    if error is not None:
        raise ChatTemplateError(f"chat template {path} {error}")
    return text

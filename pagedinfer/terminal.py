"""Lines that fit the terminal: wrapped between words, never inside a value or a path.

A line breaks only at a plain space. `keep` joins the words of one value (``1,080 tokens``, a path
with spaces, a cell of a drawing) so that no break falls inside it; a word longer than the width (a
long path) goes on a line of its own, whole. Continuation lines are indented under the line's start.
Off a terminal (a log, a pipe) lines are left whole unless ``COLUMNS`` is set: one record, one line.
Used by every line pagedinfer writes to stderr, and by `pagedinfer blocks`.
"""

from __future__ import annotations

import os
import re
import sys
from itertools import pairwise
from typing import IO

KEEP = "\u00a0"  # joins two words of one value; written as a plain space
_WORD = re.compile(r"[^ ]+")  # the text between plain spaces (a KEEP is not one)


def keep(value: str) -> str:
    """``value`` with its spaces made unbreakable."""
    return value.replace(" ", KEEP)


def columns(stream: IO | None) -> int | None:
    """The width lines written to ``stream`` must fit: ``COLUMNS`` when set (as Rich and the shell
    read it), else the terminal's when ``stream`` is one, else None (lines are left whole)."""
    given = os.environ.get("COLUMNS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    try:
        return (
            os.get_terminal_size(stream.fileno()).columns if stream is not None and stream.isatty() else None
        )
    except (OSError, ValueError, AttributeError):  # not a real file (a test's capture)
        return None


def _cells(text: str) -> int:
    from rich.cells import cell_len

    return cell_len(text)


def line_starts(plain: str, width: int, indent: int) -> list[int]:
    """Where in ``plain`` (one line) each continuation line starts, when the lines after the first
    are indented by ``indent`` columns and each must fit ``width`` (greedy, between words)."""
    starts: list[int] = []
    line, pad, has_word = 0, 0, False
    for word in _WORD.finditer(plain):
        if has_word and pad + _cells(plain[line : word.end()]) > width:
            starts.append(word.start())
            line, pad = word.start(), indent
        has_word = True
    return starts


def hanging(plain: str) -> int:
    """The default indent of a line's continuations: two columns past its own leading spaces."""
    return len(plain) - len(plain.lstrip(" ")) + 2


def fit(text: str, width: int | None, indent: int | None = None) -> str:
    """``text`` (one line, plain) wrapped to ``width`` (None: left whole), `KEEP` written as spaces."""
    if width is not None:
        pad = " " * (hanging(text) if indent is None else indent)
        starts = [0, *line_starts(text, width, len(pad)), len(text)]
        text = f"\n{pad}".join(text[a:b].rstrip(" ") for a, b in pairwise(starts))
    return text.replace(KEEP, " ")


def note(text: str) -> None:
    """Write one line (plain text) to stderr, fitted to its terminal."""
    sys.stderr.write(fit(text, columns(sys.stderr)) + "\n")
    sys.stderr.flush()


def say(console, message, indent: int | None = None) -> None:
    """Print ``message`` (Rich markup, or a Rich ``Text``) on ``console``, fitted to its terminal."""
    text = console.render_str(message, highlight=False) if isinstance(message, str) else message
    width = columns(console.file)
    lines = [text]
    if width is not None:
        pad = hanging(text.plain) if indent is None else indent
        lines = list(text.divide(line_starts(text.plain, width, pad)))
        for line in lines[1:]:
            line.pad_left(pad)
    for line in lines:
        line.rstrip()
        line.plain = line.plain.replace(KEEP, " ")  # same length: the styles stay where they were
        console.print(line, soft_wrap=True, highlight=False)

"""Lines that fit the terminal: wrapped between words, never inside a value or a path.

A line breaks only at a plain space. `keep` joins the words of one value (``1,245 tokens``, a path
with spaces, a cell of a drawing) so that no break falls inside it; a word longer than the width (a
long path) goes on a line of its own, whole. Continuation lines are indented under the line's start.
The width is Rich's (``COLUMNS``, else the terminal's); off a terminal (a log, a pipe, a captured
run) lines are left whole, one record a line, whatever ``COLUMNS`` says (Python's readline exports
one to every child process). ``TTY_COMPATIBLE=1`` (Rich's switch) makes a stream count as a terminal.
Used by every line pagedinfer writes to stderr, by the run's summary and by `pagedinfer blocks`.
"""

from __future__ import annotations

import re

KEEP = "\u00a0"  # joins two words of one value; written as a plain space
_WORD = re.compile(r"[^ ]+")  # the text between plain spaces (a KEEP is not one)


def keep(value: str) -> str:
    """``value`` with its spaces made unbreakable."""
    return value.replace(" ", KEEP)


def line_starts(plain: str, width: int, indent: int) -> list[int]:
    """Where in ``plain`` (one line) each continuation line starts, when the lines after the first
    are indented by ``indent`` columns and each must fit ``width`` (greedy, between words)."""
    from rich.cells import cell_len

    starts: list[int] = []
    line, pad, has_word = 0, 0, False
    for word in _WORD.finditer(plain):
        if has_word and pad + cell_len(plain[line : word.end()]) > width:
            starts.append(word.start())
            line, pad = word.start(), indent
        has_word = True
    return starts


def say(console, message, indent: int | None = None) -> None:
    """Print ``message`` (Rich markup, or a Rich ``Text``) on ``console``, fitted to its terminal;
    continuations are indented by ``indent`` columns (default: two past the line's own indent)."""
    text = console.render_str(message, highlight=False) if isinstance(message, str) else message
    lines = [text]
    if console.is_terminal:
        plain = text.plain
        pad = len(plain) - len(plain.lstrip(" ")) + 2 if indent is None else indent
        lines = list(text.divide(line_starts(plain, console.width, pad)))
        for line in lines[1:]:
            line.pad_left(pad)
    for line in lines:
        line.rstrip()
        line.plain = line.plain.replace(KEEP, " ")  # same length: the styles stay where they were
        console.print(line, soft_wrap=True, highlight=False)


def note(text: str) -> None:
    """Write one line (plain text, no markup) to stderr, fitted to its terminal."""
    import sys

    from rich.console import Console
    from rich.text import Text

    say(Console(file=sys.stderr, highlight=False), Text(text))

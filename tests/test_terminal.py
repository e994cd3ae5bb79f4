"""`pagedinfer.terminal`: lines fitted to the terminal, broken only between words, never inside a value."""

from __future__ import annotations

import io

from rich.console import Console
from rich.text import Text

from pagedinfer.terminal import keep, note, say

LINE = (
    "pagedinfer: note: "
    + keep("1,245 tokens")
    + " in /a/rather/long/path/to/the/kernel/cache/folder/pagedinfer (once)"
)


def said(message, width: int, terminal: bool = True, indent: int | None = None) -> list[str]:
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=terminal, color_system=None, highlight=False)
    say(console, message, indent)
    return out.getvalue().splitlines()


def test_say_breaks_between_words_keeps_values_and_indents_continuations():
    assert said(Text(LINE), 40) == [
        "pagedinfer: note: 1,245 tokens in",
        "  /a/rather/long/path/to/the/kernel/cache/folder/pagedinfer",  # longer than 40: whole, alone
        "  (once)",
    ]
    assert said(Text(LINE), 28)[:2] == ["pagedinfer: note:", "  1,245 tokens in"]  # never "1,245" alone
    assert said("  [red]✗[/] " + "word " * 12, 30)[1] == "    word word word word word"  # under its start
    assert said("[bold]a[/] b c d", 4, indent=1) == ["a b", " c d"]
    assert said(Text(LINE), 40, terminal=False) == [LINE.replace("\u00a0", " ")]  # a log, a pipe: whole


def test_note_writes_one_line_on_stderr_whole_off_a_terminal(capsys):
    note(LINE + " [not markup]")
    assert capsys.readouterr().err == LINE.replace("\u00a0", " ") + " [not markup]\n"

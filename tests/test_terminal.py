"""`pagedinfer.terminal`: lines fitted to the terminal, broken only between words, never inside a value."""

from __future__ import annotations

import io

from pagedinfer.terminal import columns, fit, keep, note

LINE = (
    "pagedinfer: note: "
    + keep("1,245 tokens")
    + " in /a/rather/long/path/to/the/kernel/cache/folder/pagedinfer (once)"
)


def test_fit_breaks_between_words_keeps_values_and_indents_continuations():
    assert fit(LINE, 40).splitlines() == [
        "pagedinfer: note: 1,245 tokens in",
        "  /a/rather/long/path/to/the/kernel/cache/folder/pagedinfer",  # longer than 40: whole, alone
        "  (once)",
    ]
    assert fit(LINE, 28).splitlines()[:2] == ["pagedinfer: note:", "  1,245 tokens in"]  # never "1,245" alone
    assert (
        fit("  ✗ " + "word " * 12, 30, indent=None).splitlines()[1].startswith("    word")
    )  # under its own start
    assert fit(LINE, None) == LINE.replace("\u00a0", " ")  # no terminal: one line, plain spaces


def test_columns_follow_COLUMNS_else_a_terminal_else_none(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    assert columns(io.StringIO()) == 60
    monkeypatch.delenv("COLUMNS")
    assert columns(io.StringIO()) is None  # a capture, a log, a pipe: lines are left whole


def test_note_writes_one_fitted_line_on_stderr(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "40")
    note(LINE)
    assert capsys.readouterr().err == fit(LINE, 40) + "\n"

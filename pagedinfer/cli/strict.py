"""``--strict``: every line checked without the model, then with it, before anything is generated or
written; bad lines are listed and the run stops (exit 1). Three reads of the input: the checks keep
nothing in memory."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.markup import escape

from pagedinfer.cli.run_options import RunOptions
from pagedinfer.lines.line import Item, LineError, LineRequest
from pagedinfer.lines.parse import parse_lines
from pagedinfer.lines.source import InputLines
from pagedinfer.terminal import say

EXIT_BAD_LINES = 1


def check(
    source: InputLines,
    opts: RunOptions,
    done: set[str],
    adapters: frozenset[str],
    load: Callable,
    err: Console,
) -> int | None:
    """The exit code when a line not ``done`` is bad (listed on ``err``), else None: the input is
    rewound for the run. ``load()`` gives what answers rows on the model, loaded."""
    bad = [i for i in _parsed(source, opts, done, adapters) if isinstance(i, LineError)]
    if bad:
        return _stop(bad, err, before="loading the model")
    source.rewind()
    requests = (i for i in _parsed(source, opts, done, adapters) if isinstance(i, LineRequest))
    first = next(requests, None)
    if first is not None:
        lines = load()
        bad = [answer.result for answer in lines.rejected(enumerate(itertools.chain([first], requests)))]
        if bad and opts.data_parallel:
            lines.close()  # the replicas end here: nothing runs
    source.rewind()
    return _stop(bad, err, before="generating") if bad else None


def _parsed(source: InputLines, opts: RunOptions, done: set[str], adapters: frozenset[str]) -> Iterator[Item]:
    return (item for item in parse_lines(source, opts.sampling, opts.seed, adapters) if item.key not in done)


def _stop(bad: list[LineError], err: Console, before: str) -> int:
    say(
        err,
        f"[bold red]--strict:[/] {len(bad)} bad line{'s' if len(bad) > 1 else ''}; stopping before {before}:",
    )
    for item in bad:
        say(err, f"  {escape(item.message)}")
    return EXIT_BAD_LINES

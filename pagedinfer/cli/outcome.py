"""What a run came to: its counts (`Outcome`), the summary it ends with, and that summary's figures
in ``--report-json``."""

from __future__ import annotations

import signal
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from pagedinfer.config import flag_of
from pagedinfer.lines.line import LineError
from pagedinfer.terminal import keep, say

if TYPE_CHECKING:
    from pagedinfer.cli.jsonl_output import Paths
    from pagedinfer.cli.line_journal import Resumed
    from pagedinfer.cli.run_options import RunOptions
    from pagedinfer.engine.llm_engine import StartedRequest

SHOW_REASONS = 10  # failed lines listed in the summary
CAP_OPTIONS = {cap: flag_of(cap) for cap in ("max_line_tokens", "line_timeout")}  # a record's capped_by


@dataclass
class Outcome:
    lines: int = 0
    skipped: int = 0  # already in the output (--resume)
    ok: int = 0
    failed: int = 0
    failed_lines: list[int] = field(default_factory=list)
    shown: list[LineError] = field(default_factory=list)  # the failures with the lowest line numbers
    kept: int = 0  # records already in the output file when this run began (--resume)
    kept_errors: int = 0  # of them, error records
    dropped: int = 0  # unreadable lines --resume removed from the output
    signal: int | None = None  # the signal that stopped the run
    write_error: str | None = None
    closed: bool = False  # the output's reader went away
    capped: Counter = field(default_factory=Counter)  # lines a per-run cap ended (CAP_OPTIONS), per cap
    unfinished: list[StartedRequest] = field(default_factory=list)  # lines started, not finished, at the end
    unfinished_kept: int | None = None  # of their tokens, those kept for --resume (None: none can be)
    resumed: Resumed | None = None  # --resume: what an earlier run kept of lines it left unfinished

    def not_run(self) -> int:
        """Lines with no record from this run or an earlier one: --resume's kept records stand for
        their lines whether this run reached them or not."""
        return max(0, self.lines - max(self.skipped, self.kept) - self.ok - self.failed)

    def not_run_words(self) -> str:
        """``N lines not run``, split into the lines a stop interrupted mid-generation (with the
        tokens they had, lost) and those not started."""
        left, cut = self.not_run(), len(self.unfinished)
        words = f"{keep(f'{left} line' + ('s' if left != 1 else ''))} not run"  # counts kept with their words
        if not cut:
            return words
        tokens = sum(x.tokens for x in self.unfinished)
        generated = keep(f"{tokens:,} token" + ("s" if tokens != 1 else ""))
        if self.unfinished_kept is None:
            kept = "not kept"
        elif self.unfinished_kept == tokens:
            kept = "all kept for --resume"
        else:
            kept = f"{keep(f'{self.unfinished_kept:,} kept')} for --resume"
        parts = [f"{keep(f'{cut} interrupted')} mid-generation ({generated} generated, {kept})"]
        if left > cut:
            parts.append(f"{keep(f'{left - cut} not')} started")
        return f"{words}: {', '.join(parts)}"

    def succeed(self, record: dict) -> None:
        from pagedinfer.lines.records import caps_of

        self.ok += 1
        self.capped.update(caps_of(record))

    def fail(self, error: LineError) -> None:
        self.failed += 1
        self.failed_lines.append(error.line)
        self.shown.append(error)
        if len(self.shown) > 2 * SHOW_REASONS:
            self.shown = sorted(self.shown, key=lambda e: e.line)[:SHOW_REASONS]


def run_summary(opts: RunOptions, outcome: Outcome, paths: Paths, stats=None) -> dict:
    """The run's own figures in ``--report-json`` (its ``run`` section)."""
    return {
        "input": str(opts.prompts),
        "output": str(paths.output) if paths.output is not None else "-",
        "model": opts.model or "pagedinfer-demo",
        "lines": outcome.lines,
        "skipped": outcome.skipped,
        "succeeded": outcome.ok,
        "failed": outcome.failed,
        "failed_lines": sorted(outcome.failed_lines),
        **{f"capped_by_{cap}": outcome.capped[cap] for cap in CAP_OPTIONS},
        "interrupted": outcome.signal is not None,
        "interrupted_lines": len(outcome.unfinished),
        "interrupted_tokens": sum(x.tokens for x in outcome.unfinished),
        "interrupted_tokens_kept": outcome.unfinished_kept or 0,
        **resumed_summary(outcome.resumed, stats),
    }


def resumed_summary(resumed: Resumed | None, stats) -> dict:
    """``--resume`` inside a line: the lines an earlier run left mid-generation that this run went on
    with, the tokens it took from it (replayed, not generated again) and those it generates again
    (the earlier run had them, not yet kept), in all and in the completion that lost the most."""
    return {
        "resumed_lines": 0 if resumed is None else len(resumed.lines),
        "resumed_tokens_recovered": 0 if stats is None else stats.output_tokens_kept,
        "resumed_tokens_recomputed": 0 if resumed is None else resumed.recomputed,
        "resumed_most_tokens_recomputed": 0 if resumed is None else resumed.most_recomputed,
    }


def summary(outcome: Outcome, where: str, stats, console: Console, on_disk: str) -> None:
    """The closing lines: the counts, the first failures, and what a stop left to do."""
    failed = sorted(outcome.shown, key=lambda e: e.line)[:SHOW_REASONS]
    caps = [
        f"{keep(f'{outcome.capped[cap]} capped')} by {option}"
        for cap, option in CAP_OPTIONS.items()
        if outcome.capped[cap]
    ]
    # a count stays with its word (terminal.keep)
    parts = [f"[green]{keep(f'{outcome.ok} ok')}[/]" + (f" ({', '.join(caps)})" if caps else "")]
    if outcome.failed:
        lines = sorted(outcome.failed_lines)
        shown = ", ".join(str(n) for n in lines[:SHOW_REASONS]) + (", …" if len(lines) > SHOW_REASONS else "")
        parts.append(
            f"[red]{keep(f'{outcome.failed} failed')}[/] (line{'s' if outcome.failed > 1 else ''} {shown})"
        )
    if outcome.skipped:
        earlier = f", {outcome.kept_errors} of them error records" if outcome.kept_errors else ""
        parts.append(f"{keep(f'{outcome.skipped} already done')} (--resume{earlier})")
    tail = ""
    if stats is not None and stats.steps:
        n = stats.completion_tokens  # what the records hold (beam search samples more than it returns)
        tokens, seconds = f"{n:,} token{'s' if n != 1 else ''}", f"{stats.wall_time_s:.2f} s"
        tail = f" · {keep(tokens)} generated in {keep(seconds)}"
    say(
        console,
        f"[bold]pagedinfer:[/] {keep(f'{outcome.lines} line' + ('s' if outcome.lines != 1 else ''))} → "
        f"{escape(keep(where))}: " + ", ".join(parts) + tail,
    )
    for e in failed:
        say(console, f"  [red]✗[/] {escape(e.message)}")
    if outcome.failed > SHOW_REASONS:
        say(
            console,
            f"  … {outcome.failed - SHOW_REASONS} more; every failed line has an error record in the output",
        )
    if (resumed := outcome.resumed) is not None and (resumed.lines or resumed.recomputed):
        n, got = len(resumed.lines), stats.output_tokens_kept if stats is not None else 0
        say(
            console,
            f"resumed {keep(f'{n} line' + ('s' if n != 1 else ''))} mid-generation: "
            f"{keep(f'{got:,} tokens')} recovered, {keep(f'{resumed.recomputed:,} recomputed')}",
        )
    if outcome.signal is not None:
        say(
            console,
            f"[bold yellow]interrupted by {signal.Signals(outcome.signal).name}:[/] {on_disk}; "
            f"{outcome.not_run_words()}; run again with --resume to complete them",
        )

"""The live progress bar of ``pagedinfer run``: lines done, tokens/s, ETA and KV pool usage."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from pagedinfer.lines.source import InputLines


class RunProgress:
    """A bar over the input's bytes read (the input is read once, so its line count is known only at
    its end), with the lines written or found done; updated after every engine step.

    The figures come first and the bar takes what width is left, so an 80-column terminal never
    cuts the count. Inert when disabled.
    """

    def __init__(self, console: Console, source: InputLines, enabled: bool) -> None:
        self.enabled = enabled and source.size > 0
        self.source = source
        self.done = 0
        self._start = time.perf_counter()
        self._progress: Progress | None = None
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]lines[/] {task.fields[done]}"),
                TextColumn("{task.percentage:>3.0f}% read"),
                TextColumn("[cyan]{task.fields[tps]} tok/s"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("[magenta]KV {task.fields[kv]}"),
                BarColumn(bar_width=None),
                console=console,
                transient=False,
                expand=True,
            )
            self._task = self._progress.add_task("run", total=source.size, tps="-", kv="-", done="0")

    def __enter__(self) -> RunProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def on_step(self, engine) -> None:
        if self._progress is None:
            return
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        tps = engine.stats.generated_tokens / elapsed
        kv = f"{engine.pool.num_used:,}/{engine.pool.num_blocks:,}"
        self._progress.update(self._task, tps=f"{tps:,.1f}", kv=kv, completed=self.source.bytes_read)

    def advance(self) -> None:
        """One more line written (or found done by --resume)."""
        self.done += 1
        if self._progress is not None:
            self._progress.update(self._task, done=f"{self.done:,}", completed=self.source.bytes_read)

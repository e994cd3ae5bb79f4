"""The live progress bar of ``pagedinfer run``: lines done, tokens/s, ETA and KV pool usage."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class RunProgress:
    """A bar over the input's lines (written or already done); updated after every engine step.

    The figures come first and the bar takes what width is left, so an 80-column terminal never
    cuts the count. Inert when disabled.
    """

    def __init__(self, console: Console, total: int, enabled: bool) -> None:
        self.enabled = enabled and total > 0
        self._start = time.perf_counter()
        self._progress: Progress | None = None
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]lines"),
                MofNCompleteColumn(),
                TextColumn("[cyan]{task.fields[tps]} tok/s"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("[magenta]KV {task.fields[kv]}"),
                BarColumn(bar_width=None),
                console=console,
                transient=False,
                expand=True,
            )
            self._task = self._progress.add_task("run", total=total, tps="-", kv="-")

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
        self._progress.update(self._task, tps=f"{tps:,.1f}", kv=kv)

    def advance(self) -> None:
        """One more line written (or found done by --resume)."""
        if self._progress is not None:
            self._progress.advance(self._task, 1)

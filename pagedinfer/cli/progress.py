"""The live progress bar of ``pagedinfer run``: completions, tokens/s, ETA and KV pool usage."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class RunProgress:
    """A bar over completions (samples); updated after every engine step. Inert when disabled."""

    def __init__(self, console: Console, total: int, enabled: bool) -> None:
        self.enabled = enabled and total > 0
        self._start = time.perf_counter()
        self._progress: Progress | None = None
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]completions"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("[cyan]{task.fields[tps]:>9} tok/s"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("[magenta]KV {task.fields[kv]}"),
                console=console,
                transient=False,
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
        kv = f"{engine.pool.num_used:,}/{engine.pool.num_blocks:,} blocks"
        self._progress.update(self._task, tps=f"{tps:,.1f}", kv=kv)

    def advance(self, completions: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, completions)

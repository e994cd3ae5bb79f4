"""Stop signals of a run: SIGINT, SIGTERM and SIGHUP finish the current engine step, a second one
(or one outside generation) stops at once; the exit code is 128 + the signal's number."""

from __future__ import annotations

import contextlib
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # exit code 128 + the signal's number


class Interrupted(BaseException):
    """A stop signal arrived during generation; raised between engine steps (and during a line's chat
    template: a BaseException, so no ``except Exception`` on its way takes it for the line's failure)."""


class Stopped(BaseException):
    """A stop signal that ends the run at once (before generation, or a second signal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP: during generation the first one finishes the current engine step
    (then everything finished is on disk and the report is printed); otherwise, or a second time,
    the run stops at once. `install` again takes them back from a library that replaced them (Ray)."""

    def __init__(self) -> None:
        self.requested: int | None = None
        self.generating = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.generating and self.requested is None:
            self.requested = signum
            return
        raise Stopped(signum)

    def install(self) -> None:
        with contextlib.suppress(ValueError):  # not the main thread: keep the default behaviour
            for sig in STOP_SIGNALS:
                previous = signal.signal(sig, self._handle)
                self._previous.setdefault(sig, previous)

    def interrupt(self) -> None:
        """Raise `Interrupted` when a stop was asked for during generation (called between steps)."""
        if self.requested is not None:
            raise Interrupted

    def __enter__(self) -> StopSignals:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

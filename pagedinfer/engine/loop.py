"""The one generation loop: prepared requests in, engine steps, finished outputs out.

`LLM.stream` (so `LLM.generate`) and ``pagedinfer run`` pull requests from a lazy feed while fewer
than a window of them are unfinished (`GenerationLoop.stream`); a Ray replica pushes rows in and
steps for a time budget (`add`, `step`). Either way a step that raises (a request the model, the
sampler or the detokenizer cannot serve) does not end the others: every request that was inside the
engine runs again, half apart from half, until the one at fault is alone and fails with the error.
The others complete as an uninterrupted run would have them: their completions are seeded from their
own seeds and restart from their first token. The engine's figures count the reruns too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pagedinfer.core.sequence import Request
from pagedinfer.engine.intake import EngineRequest, Rejected
from pagedinfer.engine.llm_engine import LLMEngine, StartedRequest
from pagedinfer.errors import first_line
from pagedinfer.outputs import BeamSearchOutput, RequestOutput

Output = RequestOutput | BeamSearchOutput
Finished = tuple[Any, Output]  # (the caller's tag for the request, its output)


class GenerationLoop:
    """Runs prepared requests on ``engine``; ``before_step`` runs before every step (the CLI makes
    the lines it wrote durable there), ``on_step(engine)`` after it (progress; it may raise to stop)."""

    def __init__(
        self,
        engine: LLMEngine,
        before_step: Callable[[], None] | None = None,
        on_step: Callable[[LLMEngine], None] | None = None,
    ) -> None:
        self.engine = engine
        self.before_step = before_step
        self.on_step = on_step
        self._inside: dict[int, tuple[Any, EngineRequest]] = {}  # order -> (tag, request) in the engine
        self._next = 0
        self.dropped: list[StartedRequest] = []  # the started requests the last `close` dropped

    @property
    def pending(self) -> int:
        """Requests inside the engine, not finished yet."""
        return len(self._inside)

    def tags(self) -> list[Any]:
        """The tags of the requests inside the engine."""
        return [tag for tag, _ in self._inside.values()]

    def generating(self) -> list[tuple[Any, Request]]:
        """(tag, request) of the requests inside the engine whose completions hold generated tokens
        (`LLMEngine.generating`)."""
        found = self.engine.generating()
        return [(entry[0], found[order]) for order, entry in self._inside.items() if order in found]

    def add(self, tag: Any, prepared: EngineRequest | Rejected) -> list[Finished]:
        """Queue one request; a rejected one is answered at once (returned)."""
        order, self._next = self._next, self._next + 1
        req = self.engine.add_request(prepared, order)
        if req.error:
            return [(tag, self.engine.output(req))]
        self._inside[order] = (tag, prepared)
        return []

    def step(self) -> list[Finished]:
        """One engine step (or, when it raised, the reruns that isolate its fault)."""
        return list(self._step())

    def stream(
        self, feed: Iterable[tuple[Any, EngineRequest | Rejected | None]], window: int | None = None
    ) -> Iterator[tuple[Any, Output | None]]:
        """Run ``feed``'s ``(tag, request)`` pairs, read lazily, at most ``window`` unfinished at once
        (default: twice ``max_num_seqs``, enough to keep every batch full, so memory does not grow with
        the number of requests); yield ``(tag, output)`` as each finishes. A pair without a request
        (None: the caller answers it, a line that did not parse) comes back at once as ``(tag, None)``,
        in the same stream. The engine's figures count this stream alone. Closing the generator drops
        the unfinished ones and frees their blocks."""
        window = 2 * self.engine.config.max_num_seqs if window is None else window
        if window < 1:
            raise ValueError("the window of unfinished requests must be >= 1")
        self.engine.reset_stats()
        stats = self.engine.stats  # this stream's record: its wall time is kept current
        feed, more, start = iter(feed), True, time.perf_counter()
        try:
            while True:
                while more and len(self._inside) < window:
                    item = next(feed, None)
                    if item is None:
                        more = False
                    elif item[1] is None:
                        yield item
                    else:
                        yield from self.add(*item)
                if not self._inside:
                    return
                for done in self._step():
                    stats.wall_time_s = time.perf_counter() - start
                    yield done
                stats.wall_time_s = time.perf_counter() - start
        finally:
            stats.wall_time_s = time.perf_counter() - start
            self.close()

    def close(self) -> None:
        """Drop every unfinished request and return its blocks to the pool; those that had started
        are kept in ``dropped`` (a stopped run counts them)."""
        self.dropped = self.engine.started_requests()
        self.engine.abort_all()
        self._inside.clear()

    def _step(self) -> Iterator[Finished]:
        if self.before_step is not None:
            self.before_step()
        try:
            finished = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - one request's fault must not end the others
            yield from self._isolate(exc)
            return
        for req in finished:
            yield self._inside.pop(req.order)[0], self.engine.output(req)
        if self.on_step is not None:  # after the answers: a stop it raises loses none of them
            self.on_step(self.engine)

    def _isolate(self, exc: Exception) -> Iterator[Finished]:
        """Rerun the requests that were inside when a step raised, half apart from half; a half whose
        step raises again is halved the same way (its `_step` lands here), until the one at fault is
        alone: it fails with the error."""
        inside = sorted(self._inside.items())
        self.close()
        if len(inside) == 1:
            yield self._failed(*inside[0], exc)
            return
        half = len(inside) // 2
        for group in (inside[:half], inside[half:]):
            for order, (tag, prepared) in group:
                self.engine.add_request(prepared, order)
                self._inside[order] = (tag, prepared)
            while self._inside:
                yield from self._step()

    def _failed(self, order: int, entry: tuple[Any, EngineRequest], exc: Exception) -> Finished:
        tag, prepared = entry
        reason = f"the engine failed on this request: {type(exc).__name__}: {first_line(exc, '')}".rstrip(
            ": "
        )
        params = prepared.beam if prepared.beam is not None else prepared.params
        rejected = Rejected(prepared.request_id, prepared.prompt, prepared.prompt_token_ids, params, reason)
        return tag, self.engine.output(self.engine.add_request(rejected, order))

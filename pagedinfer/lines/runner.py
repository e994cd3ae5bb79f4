"""Rows in, records out: one line's way from its parsed form to its record, for ``pagedinfer run`` and
every Ray replica alike.

A row is ``(position, line)``: the line's place in the input (or the job), which is what identifies it
through the engine and the replicas, and the line as parsed, a `LineRequest` or the `LineError`
parsing found. `LineRunner` answers every row with an `Answer`: its position, its key and what became
of it, a success record or a `LineError`. A request is prepared against the model once (`LLM.prepare`)
and run in the one generation loop (`LLM.loop`); a row that parsing refused comes back in the same
stream, so the caller writes every line in one place. Nothing raised for one row reaches the caller
(the loop isolates a row that makes a step raise; a record that cannot be built is that row's error).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from pagedinfer.core.sequence import KeptLine, Request, request_identity
from pagedinfer.engine.intake import EngineRequest, Rejected
from pagedinfer.engine.llm_engine import StartedRequest
from pagedinfer.lines.line import Item, LineError, LineRequest
from pagedinfer.lines.records import TokenText, error_record, success_record
from pagedinfer.llm import LLM
from pagedinfer.lora.adapter import AdapterError
from pagedinfer.lora.request import LoRARequest
from pagedinfer.outputs import BeamSearchOutput, RequestOutput

Row = tuple[int, Item]  # (position, the line as parsed)


@dataclass
class Answer:
    """What became of one line: its success record, or why it failed."""

    position: int
    key: str  # the line's key (`line.line_key`): what --resume and the final order know it by
    result: dict | LineError

    @property
    def record(self) -> dict:
        """The output record: the success record, or the error record naming the line."""
        return error_record(self.result) if isinstance(self.result, LineError) else self.result


class LineRunner:
    """Answers rows on one `LLM`: all at once (`run`, the command line) or pushed in and stepped
    (`add`, `step`: a Ray replica, whose engine keeps running between calls)."""

    def __init__(self, llm: LLM, model_name: str, loras: Iterable[tuple[str, str]] = ()) -> None:
        """``model_name``: the run's model, for OpenAI lines whose body names none. ``loras``: the
        run's adapters (name, directory), which lines name, read and checked now (an `AdapterError`
        names the ``--lora`` at fault)."""
        for i, (name, path) in enumerate(loras, start=1):
            try:
                llm.add_lora(LoRARequest(name, i, path))
            except AdapterError as e:
                raise AdapterError(f"--lora {name}={path}: {e}") from None
        self.llm = llm
        self.model_name = model_name
        self.token_text = TokenText(llm.engine.loaded.tokenizer)  # the engine's own (no transformers)
        self._loop = llm.loop()
        self.kept: dict[str, KeptLine] = {}  # by line key: what an earlier run generated (--resume)

    def run(
        self,
        rows: Iterable[Row],
        before_step: Callable[[], None] | None = None,
        on_step: Callable[[LLM], None] | None = None,
        interrupt: Callable[[], None] | None = None,
    ) -> Iterator[Answer]:
        """Each row's answer as it finishes, ``rows`` read lazily (at most a window of them unfinished
        in the engine). ``before_step`` runs before every engine step, ``on_step(llm)`` after it and
        ``interrupt`` while a chat template renders; what the last two raise stops the run. Closing
        the generator drops the unfinished rows (`dropped` names those that had started)."""
        self._loop = self.llm.loop(before_step, lambda engine: on_step(self.llm) if on_step else None)
        feed = (
            (row, None if isinstance(row[1], LineError) else self._prepare(row[1], interrupt)) for row in rows
        )
        stream = self._loop.stream(feed)
        try:
            for row, output in stream:
                yield self._answer(row, output)
        finally:
            stream.close()

    @property
    def dropped(self) -> list[StartedRequest]:
        """The started rows the last `run` dropped unfinished (a stopped run counts them)."""
        return self._loop.dropped

    def add(self, rows: Iterable[Row]) -> list[Answer]:
        """Queue ``rows`` in the running engine; those answered at once (refused) are returned."""
        answers = []
        for row in rows:
            if isinstance(row[1], LineError):
                answers.append(self._answer(row, None))
            else:
                answers += [self._answer(*done) for done in self._loop.add(row, self._prepare(row[1]))]
        return answers

    def step(self) -> list[Answer]:
        """One engine step; the rows it finished."""
        return [self._answer(*done) for done in self._loop.step()]

    @property
    def pending(self) -> int:
        """Rows inside the engine, not finished yet."""
        return self._loop.pending

    def positions(self) -> list[int]:
        """The positions of the rows inside the engine."""
        return [position for position, _ in self._loop.tags()]

    def generating(self) -> list[tuple[str, Request]]:
        """(line key, request) of the lines inside the engine that hold generated tokens now."""
        return [(item.key, req) for (_, item), req in self._loop.generating()]

    def rejected(self, rows: Iterable[tuple[int, LineRequest]]) -> list[Answer]:
        """The rows the model or the pool can never run, with why (``--strict`` stops on them)."""
        checked = ((row, self._prepare(row[1])) for row in rows)
        return [
            Answer(position, item.key, item.failed(prepared.reason))
            for (position, item), prepared in checked
            if isinstance(prepared, Rejected)
        ]

    def _prepare(
        self, item: LineRequest, interrupt: Callable[[], None] | None = None
    ) -> EngineRequest | Rejected:
        prepared = self.llm.prepare(item.prompt, item.params, str(item.id), item.lora, interrupt)
        kept = self.kept.pop(item.key, None)
        if isinstance(prepared, EngineRequest) and kept is not None:
            p = prepared
            if kept.identity == request_identity(p.seed, p.prompt_token_ids, p.params.n):
                prepared.kept = kept.completions
        return prepared

    def _answer(self, row: Row, output: RequestOutput | BeamSearchOutput | None) -> Answer:
        position, item = row
        if output is None:  # parsing refused it
            return Answer(position, item.key, item)
        if output.error:
            return Answer(position, item.key, item.failed(output.error))
        try:
            fingerprint = self.llm.system_fingerprint(item.lora)
            record = success_record(item, output, self.token_text, self.model_name, fingerprint)
            return Answer(position, item.key, record)
        except Exception as e:  # noqa: BLE001 - one line's bad output must not end the run
            return Answer(
                position, item.key, item.failed(f"could not build the output: {type(e).__name__}: {e}")
            )

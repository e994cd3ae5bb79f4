"""One engine replica: a `pagedinfer.LLM` that takes parsed rows and answers every row alone.

A plain class (no Ray import): the driver and the Ray Data processor wrap it in an actor. Rows are
`(position, LineRequest)` pairs; the replica prepares each one against its own model and pool (the
one intake, `engine.intake.prepare`), runs it in the one generation loop (`engine.loop`), and
returns `(position, record or LineError, completions)`. Records are built here, next to the tokenizer,
so only rows and finished records cross the network. Nothing raised for one row reaches the caller:
a row that fails becomes its own `LineError` (the loop isolates a row that makes a step raise).

The engine keeps running between `pump` calls: rows sent in later calls join the running batch,
so continuous batching stays full across batch boundaries.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass

from pagedinfer.engine.intake import Rejected
from pagedinfer.engine.llm_engine import StartedRequest
from pagedinfer.engine.loop import GenerationLoop
from pagedinfer.lines.line import LineError, LineRequest
from pagedinfer.lines.records import TokenText, success_record

Row = tuple[int, LineRequest]  # (position in the job, the validated line)
Done = tuple[int, "dict | LineError", int]  # (position, success record or error, completions it counted for)


@dataclass
class Live:
    """A replica's figures for the progress bar, sent back with every pump."""

    generated_tokens: int
    blocks_used: int
    num_blocks: int
    started: list[StartedRequest]  # its started unfinished requests (`LLMEngine.started_requests`)


@dataclass
class Reply:
    """What one `pump` returns: the finished rows and what the engine still holds."""

    done: list[Done]
    running: list[int]  # positions still inside this engine (a restarted replica holds none)
    instance: str  # changes when Ray restarts the replica
    live: Live


class EngineReplica:
    """Holds one `LLM`; `pump` feeds it rows and steps it for a while, returning what finished."""

    def __init__(
        self,
        model: str | None,
        engine_kwargs: dict,
        seed: int,
        threads: int | None,
        model_name: str,
        loras: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """``loras``: the ``--lora`` adapters (name, directory), read and checked now as the
        single-process run does; one that does not fit the model ends the replica's start with its error."""
        import torch
        from transformers.utils import logging as hf_logging

        from pagedinfer.llm import LLM
        from pagedinfer.lora.adapter import AdapterError
        from pagedinfer.lora.request import LoRARequest

        if threads:
            torch.set_num_threads(threads)
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.llm = LLM(model, seed=seed, **engine_kwargs)
        self.engine = self.llm.engine
        for i, (name, path) in enumerate(loras, start=1):
            try:
                self.engine.add_lora(LoRARequest(name, i, path))
            except AdapterError as e:
                raise AdapterError(f"--lora {name}={path}: {e}") from None
        self.engine.system_fingerprint()  # in its records, its figures and its info
        self.loop = GenerationLoop(self.engine)
        self.model_name = model_name
        self.token_text = TokenText(self.llm.tokenizer)
        self.busy_s = 0.0
        self.instance = uuid.uuid4().hex

    def info(self) -> dict:
        """Where this replica runs (the actor-kill test and the report use it)."""
        import torch

        try:
            import ray

            node = ray.get_runtime_context().get_node_id()
        except (ImportError, AttributeError):
            node = None
        return {
            "pid": os.getpid(),
            "instance": self.instance,
            "node": node,
            "host": socket.gethostname(),
            "device": str(self.engine.loaded.device),
            "threads": torch.get_num_threads(),
            "num_blocks": self.engine.pool.num_blocks,
            "context": self.engine.loaded.max_model_len,  # the model's own (the driver's --max-model-len note)
            "system_fingerprint": self.engine.system_fingerprint(),
        }

    def check(self, rows: list[Row]) -> list[tuple[int, LineError]]:
        """The rows the model or the pool can never run (``--strict`` stops on them before generating)."""
        checked = (
            (pos, item, self.engine.intake.prepare(item.prompt, item.params, str(item.id), item.lora))
            for pos, item in rows
        )
        return [(pos, item.failed(p.reason)) for pos, item, p in checked if isinstance(p, Rejected)]

    def pump(self, rows: list[Row], budget_s: float) -> Reply:
        """Add ``rows`` to the engine, step it for about ``budget_s`` (less when it runs dry); return what finished."""
        start = time.perf_counter()
        finished = []
        for pos, item in rows:
            finished += self.loop.add(
                (pos, item), self.engine.intake.prepare(item.prompt, item.params, str(item.id), item.lora)
            )
        while self.loop.pending and time.perf_counter() - start < budget_s:
            finished += self.loop.step()
        self.busy_s += time.perf_counter() - start
        self.engine.stats.wall_time_s = self.busy_s
        pool = self.engine.pool
        live = Live(
            self.engine.stats.generated_tokens, pool.num_used, pool.num_blocks, self.engine.started_requests()
        )
        running = [pos for pos, _ in self.loop.tags()]
        return Reply([self._answer(*f) for f in finished], running, self.instance, live)

    def run_all(self, rows: list[Row]) -> list[Done]:
        """Every row to completion (one Ray Data batch)."""
        return self.pump(rows, float("inf")).done

    def stats(self):
        """This replica's `EngineStats` since it started (all its pumps)."""
        return self.engine.stats

    def _answer(self, tag: Row, out) -> Done:
        pos, item = tag
        if out.error:
            return pos, item.failed(out.error), item.params.n
        fingerprint = self.engine.system_fingerprint(item.lora)
        return pos, success_record(item, out, self.token_text, self.model_name, fingerprint), item.params.n

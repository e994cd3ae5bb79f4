"""One engine replica: a `pagedinfer.LLM` that takes parsed rows and answers every row alone.

A plain class (no Ray import): the driver and the Ray Data processor wrap it in an actor. Rows are
`(position, LineRequest)` pairs; the replica answers them with the line runner the command line
uses (`lines.runner`): each prepared against its own model and pool, run in the one generation
loop, answered with its `Answer` (a record or a `LineError`). Records are built here, next to the
tokenizer, so only rows and finished records cross the network.

The engine keeps running between `pump` calls: rows sent in later calls join the running batch,
so continuous batching stays full across batch boundaries.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass

from pagedinfer.config import LLMConfig
from pagedinfer.engine.llm_engine import StartedRequest
from pagedinfer.lines.runner import Answer, LineRunner, Row


@dataclass
class Live:
    """A replica's figures for the progress bar, sent back with every pump."""

    generated_tokens: int
    kv_blocks: tuple[int, int]  # (in use, in the pool)
    started: list[StartedRequest]  # its started unfinished requests (`LLM.started_requests`)


@dataclass
class Reply:
    """What one `pump` returns: the finished rows and what the engine still holds."""

    done: list[Answer]
    running: list[int]  # positions still inside this engine (a restarted replica holds none)
    instance: str  # changes when Ray restarts the replica
    live: Live


class EngineReplica:
    """Holds one `LLM`; `pump` feeds it rows and steps it for a while, returning what finished."""

    def __init__(
        self,
        config: LLMConfig,
        threads: int | None,
        model_name: str,
        loras: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """``loras``: the ``--lora`` adapters (name, directory), read and checked now as the
        single-process run does; one that does not fit the model ends the replica's start with its error."""
        import torch

        from pagedinfer.hf_logging import quiet_transformers
        from pagedinfer.llm import LLM

        if threads:
            torch.set_num_threads(threads)
        quiet_transformers()
        self.llm = LLM.from_config(config)
        self.runner = LineRunner(self.llm, model_name, loras)
        self.llm.system_fingerprint()  # in its records, its figures and its info
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
            "device": str(self.llm.device),
            "threads": torch.get_num_threads(),
            "num_blocks": self.llm.kv_blocks[1],
            "context": self.llm.context_length,  # the model's own (the driver's --max-model-len note)
            "system_fingerprint": self.llm.system_fingerprint(),
        }

    def check(self, rows: list[Row]) -> list[Answer]:
        """The rows the model or the pool can never run (``--strict`` stops on them before generating)."""
        return self.runner.rejected(rows)

    def pump(self, rows: list[Row], budget_s: float) -> Reply:
        """Add ``rows`` to the engine, step it for about ``budget_s`` (less when it runs dry); return what finished."""
        start = time.perf_counter()
        done = self.runner.add(rows)
        while self.runner.pending and time.perf_counter() - start < budget_s:
            done += self.runner.step()
        self.busy_s += time.perf_counter() - start
        self.llm.stats.wall_time_s = self.busy_s
        live = Live(self.llm.stats.generated_tokens, self.llm.kv_blocks, self.llm.started_requests())
        return Reply(done, self.runner.positions(), self.instance, live)

    def run_all(self, rows: list[Row]) -> list[Answer]:
        """Every row to completion (one Ray Data batch)."""
        return self.pump(rows, float("inf")).done

    def stats(self):
        """This replica's `EngineStats` since it started (all its pumps)."""
        return self.llm.stats

"""One engine replica: a `pagedinfer.LLM` that takes validated rows and answers every row alone.

A plain class (no Ray import): the driver and the Ray Data processor wrap it in an actor. Rows are
`(position, LineRequest)` pairs; the replica tokenizes and checks each one against its own pool
(`cli.resolve`), runs it, and returns `(position, record or LineError, samples)`. Records are built
here, next to the tokenizer, so only rows and finished records cross the network. Nothing raised
for one row reaches the caller: a row that fails becomes its own `LineError`.

The engine keeps running between `pump` calls: rows sent in later calls join the running batch,
so continuous batching stays full across batch boundaries.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass

from pagedinfer.cli.jsonl_input import LineError, LineRequest
from pagedinfer.cli.records import TokenText, success_record
from pagedinfer.cli.resolve import Resolved, resolve

Row = tuple[int, LineRequest]  # (position in the job, the validated line)
Done = tuple[int, "dict | LineError", int]  # (position, success record or error, samples it counted for)


@dataclass
class Live:
    """A replica's figures for the progress bar, sent back with every pump."""

    generated_tokens: int
    blocks_used: int
    num_blocks: int


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
        self, model: str | None, engine_kwargs: dict, seed: int, threads: int | None, model_name: str
    ) -> None:
        import torch
        from transformers.utils import logging as hf_logging

        from pagedinfer.llm import LLM

        if threads:
            torch.set_num_threads(threads)
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.llm = LLM(model, seed=seed, **engine_kwargs)
        self.engine = self.llm.engine
        self.model_name = model_name
        self.token_text = TokenText(self.llm.tokenizer)
        self.running: dict[int, Resolved] = {}  # position -> row inside the engine
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
        }

    def check(self, rows: list[Row]) -> list[tuple[int, LineError]]:
        """The rows the model or the pool can never run (``--strict`` stops on them before generating)."""
        return [(pos, res) for pos, item in rows if isinstance(res := resolve(item, self.engine), LineError)]

    def pump(self, rows: list[Row], budget_s: float) -> Reply:
        """Add ``rows`` to the engine, step it for about ``budget_s`` (less when it runs dry); return what finished."""
        start = time.perf_counter()
        done: list[Done] = []
        for pos, item in rows:
            res = resolve(item, self.engine)
            if isinstance(res, LineError):
                done.append((pos, res, item.params.n))
                continue
            req = self.engine.add_request(res.engine_prompt, item.params, request_id=str(item.id), order=pos)
            if req.error:
                done.append((pos, _failure(item, req.error), item.params.n))
            else:
                self.running[pos] = res
        while self.engine.has_unfinished and time.perf_counter() - start < budget_s:
            try:
                finished = self.engine.step()
            except Exception:  # noqa: BLE001 - one row's fault must not fail the others: rerun each alone
                done.extend(self._isolate())
                break
            done.extend(self._answer(req) for req in finished)
        self.busy_s += time.perf_counter() - start
        self.engine.stats.wall_time_s = self.busy_s
        pool = self.engine.pool
        live = Live(self.engine.stats.generated_tokens, pool.num_used, pool.num_blocks)
        return Reply(done, list(self.running), self.instance, live)

    def run_all(self, rows: list[Row]) -> list[Done]:
        """Every row to completion (one Ray Data batch)."""
        return self.pump(rows, float("inf")).done

    def stats(self):
        """This replica's `EngineStats` since it started (all its pumps)."""
        return self.engine.stats

    def _answer(self, req) -> Done:
        res = self.running.pop(req.order)
        out = req.to_output()
        if out.error:
            return req.order, _failure(res.item, out.error), res.item.params.n
        return req.order, success_record(res, out, self.token_text, self.model_name), res.item.params.n

    def _isolate(self) -> list[Done]:
        """The engine raised mid-step: run each row that was inside it alone; the guilty one fails alone."""
        self.engine.abort_all()
        rows, self.running = sorted(self.running.items()), {}
        done: list[Done] = []
        for pos, res in rows:
            self.running[pos] = res
            try:
                self.engine.add_request(
                    res.engine_prompt, res.item.params, request_id=str(res.item.id), order=pos
                )
                while self.engine.has_unfinished:
                    done.extend(self._answer(req) for req in self.engine.step())
            except Exception as e:  # noqa: BLE001 - becomes this row's error record
                self.engine.abort_all()
                self.running.pop(pos, None)
                reason = f"the engine failed on this line: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                done.append((pos, _failure(res.item, reason.rstrip(": ")), res.item.params.n))
        return done


def _failure(item: LineRequest, reason: str) -> LineError:
    return LineError(item.line, item.key, item.id, reason, item.openai, item.openai is not None)

"""The data-parallel feed of ``pagedinfer run --data-parallel N``: N `EngineReplica` actors on Ray.

The driver keeps every row's position; replicas only see rows and send back finished records, so
the CLI writes, orders, resumes and reports exactly as it does in one process. Each replica holds
up to ``window`` rows (its running batch plus a queue), topped up on every `pump` reply, so its
continuous batching never drains between batches. A replica that dies (kill -9, a lost node) is
restarted by Ray; the rows it held go back to the front of the queue and run again, on any replica,
with the same seeds, so the output does not change.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from pagedinfer.config import LLMConfig
from pagedinfer.engine.llm_engine import StartedRequest
from pagedinfer.errors import first_line, last_line
from pagedinfer.lines.line import LineError, LineRequest
from pagedinfer.lines.runner import Answer, Row
from pagedinfer.ray.actor import EngineReplica, Live

PUMP_S = 0.25  # engine time per pump call: short enough for a live progress bar and quick top-ups
MAX_ATTEMPTS = 3  # a row held by a replica that died this many times gets an error record
CONNECT_TIMEOUT_S = 5.0  # how long --ray-address may take to answer


class RayUnavailable(Exception):
    """Ray is missing or cannot start/join; the message is one line."""


@dataclass
class ReplicaSpec:
    """What every replica loads, and how many there are."""

    llm: LLMConfig  # every replica's `LLM` (its model, seed and engine settings)
    replicas: int = 2
    address: str | None = None  # None: start a local Ray for this run and stop it after
    model_name: str = "pagedinfer-demo"
    window: int | None = None  # rows held per replica (default: 2 × max_num_seqs)
    loras: tuple[tuple[str, str], ...] = ()  # --lora adapters (name, directory) every replica loads


def import_ray(command: str):
    """Ray, or a one-line error naming the command that needed it."""
    try:
        import ray
    except ImportError:
        raise RayUnavailable(f"{command} needs Ray: pip install 'pagedinfer[ray]'") from None
    return ray


def _check_reachable(address: str) -> None:
    """Fail within `CONNECT_TIMEOUT_S` when nothing listens at ``host:port`` (Ray itself retries for minutes)."""
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if target == "auto" or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise RayUnavailable(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None


def cpu_share(cpus: float, replicas: int) -> float:
    """CPUs per replica: whole CPUs when there are enough, else an equal fraction (threads: at least 1)."""
    share = cpus / replicas
    return float(int(share)) if share >= 1 else share


@dataclass
class _Progress:
    """Sums of the replicas' latest `Live` figures, read as one `LLM`'s (`cli.progress.RunProgress.on_step`)."""

    live: dict[int, Live] = field(default_factory=dict)

    @property
    def stats(self) -> _Progress:
        return self

    @property
    def generated_tokens(self) -> int:
        return sum(v.generated_tokens for v in self.live.values())

    @property
    def kv_blocks(self) -> tuple[int, int]:
        used = sum(v.kv_blocks[0] for v in self.live.values())
        return used, sum(v.kv_blocks[1] for v in self.live.values())

    def started_requests(self) -> list[StartedRequest]:
        """Every replica's started unfinished requests, as of its latest reply, longest running first."""
        return sorted((x for v in self.live.values() for x in v.started), key=lambda x: -x.running_s)


class DataParallelEngines:
    """N replicas on a local or joined Ray cluster; `run` yields each row's result as it finishes."""

    def __init__(self, spec: ReplicaSpec, command: str = "pagedinfer run --data-parallel") -> None:
        self.ray = ray = import_ray(command)
        self.spec = spec
        self._started_ray = False
        self._t0 = time.perf_counter()
        if not ray.is_initialized():
            kwargs: dict = {
                "include_dashboard": False,
                "logging_level": logging.WARNING,
                "log_to_driver": False,
            }
            if spec.address is None:
                kwargs["num_cpus"] = os.cpu_count() or 1
            else:
                _check_reachable(spec.address)
            try:
                ray.init(address=spec.address, **kwargs)
            except (ConnectionError, RuntimeError, ValueError) as e:
                where = f"the Ray cluster at {spec.address}" if spec.address else "a local Ray"
                raise RayUnavailable(f"cannot start {where}: {first_line(e)}") from None
            self._started_ray = True
        self.startup_s = time.perf_counter() - self._t0
        self.actors: list = []
        self.restarts = [0] * spec.replicas
        self.rerun_rows = 0
        self.progress = _Progress()
        self.wall_time_s = 0.0
        self._stats = None
        self.replicas: list[dict] = []
        try:
            options, threads = self._resources()
            actor = ray.remote(EngineReplica).options(
                max_restarts=-1, max_task_retries=0, scheduling_strategy="SPREAD", **options
            )
            args = (spec.llm, threads, spec.model_name, spec.loras)
            self.actors = [actor.remote(*args) for _ in range(spec.replicas)]
            self.infos = ray.get([a.info.remote() for a in self.actors])
        except ray.exceptions.RayActorError as e:
            for a in self.actors:  # no figures to read from replicas that never started
                ray.kill(a)
            self.actors = []
            self.close()
            raise RayUnavailable(f"a replica failed to start: {_replica_error(e)}") from None
        except RayUnavailable:
            self.close()
            raise
        self.ready_s = time.perf_counter() - self._t0

    def _resources(self) -> tuple[dict, int]:
        """Actor options and torch threads: one GPU each on GPU clusters, else the CPUs split evenly."""
        resources = self.ray.cluster_resources()
        n = self.spec.replicas
        gpus = int(resources.get("GPU", 0))
        device = self.spec.llm.model_config.device
        if gpus and device != "cpu":
            if gpus < n:
                raise RayUnavailable(f"--data-parallel {n} needs {n} GPUs; the Ray cluster has {gpus}")
            return {"num_gpus": 1, "num_cpus": 1}, 0
        share = cpu_share(resources.get("CPU", 1.0), n)
        return {"num_cpus": share}, max(1, int(share))

    # -- the feed --------------------------------------------------------------------------------
    @property
    def context_length(self) -> int:
        """The model's own context length (every replica loads the same model)."""
        return self.infos[0]["context"]

    def system_fingerprint(self) -> str:
        """What decides the replicas' records (docs/reproducibility.md): theirs, one unless they differ."""
        return ",".join(sorted({info["system_fingerprint"] for info in self.infos}))

    @property
    def dropped(self) -> list[StartedRequest]:
        """The started rows the replicas held unfinished, as of each one's last reply."""
        return self.progress.started_requests()

    def rejected(self, rows: Iterable[tuple[int, LineRequest]]) -> list[Answer]:
        """Rows no replica could ever run (too long for the model or the pool); for ``--strict``."""
        rows = list(rows)
        chunks = [rows[i :: len(self.actors)] for i in range(len(self.actors))]
        found = self.ray.get([a.check.remote(c) for a, c in zip(self.actors, chunks, strict=True) if c])
        return sorted((x for part in found for x in part), key=lambda answer: answer.position)

    def run(
        self, rows: Iterable[Row], on_step: Callable[[_Progress], None] | None = None
    ) -> Iterator[Answer]:
        """Each row's answer as it finishes, ``rows`` pulled lazily (`lines.runner`'s rows and
        answers: a row parsing refused comes back as it is pulled).

        ``on_step(progress)`` is called after every replica reply with the replicas' summed figures
        (it may raise to stop the run; closing the generator drops the replicas' unfinished work).
        """
        ray = self.ray
        window = self.spec.window or 2 * self.spec.llm.engine_config.max_num_seqs
        source = iter(rows)
        retry: deque[tuple[int, LineRequest]] = deque()
        refused: list[Answer] = []  # rows parsing refused, answered as they are pulled
        attempts: dict[int, int] = {}
        held: list[dict[int, LineRequest]] = [{} for _ in self.actors]  # rows each replica holds
        pending: dict = {}  # ref -> (replica index, "pump" or "probe")
        start = time.perf_counter()

        def take(k: int) -> list[tuple[int, LineRequest]]:
            out = []
            while len(out) < k and retry:
                out.append(retry.popleft())
            while len(out) < k and (row := next(source, None)) is not None:
                if isinstance(row[1], LineError):
                    refused.append(Answer(row[0], row[1].key, row[1]))
                else:
                    out.append(row)
            return out

        def submit(i: int) -> None:
            new = take(window - len(held[i]))
            held[i].update(new)
            if held[i]:
                pending[self.actors[i].pump.remote(new, PUMP_S)] = (i, "pump")

        try:
            for _ in range(window):  # the first rows go round-robin, so a short job still uses every replica
                for rows_i in held:
                    rows_i.update(take(1))
            for i, rows_i in enumerate(held):
                if rows_i:
                    pending[self.actors[i].pump.remote(list(rows_i.items()), PUMP_S)] = (i, "pump")
            yield from refused
            refused.clear()
            while pending:
                (ref,), _ = ray.wait(list(pending), num_returns=1)
                i, kind = pending.pop(ref)
                done: list = []
                try:
                    reply = ray.get(ref)
                except ray.exceptions.RayActorError:  # died (or is restarting): Ray restarts it
                    if kind == "pump":
                        done = self._requeue(held[i], retry, attempts)
                        held[i] = {}
                        self.progress.live.pop(i, None)
                    else:
                        time.sleep(PUMP_S)  # still restarting: ask again shortly
                    pending[self.actors[i].info.remote()] = (i, "probe")  # back when this answers
                    continue
                if kind == "probe":  # a restarted replica is up: it holds nothing yet
                    self._restarted(i, reply["instance"])
                else:
                    done = reply.done
                    self.progress.live[i] = reply.live
                    self._restarted(i, reply.instance)
                    finished = {answer.position for answer in done}
                    lost = {
                        p: r for p, r in held[i].items() if p not in finished and p not in set(reply.running)
                    }
                    if lost:  # a restart between two pumps: the rows the old process held are gone
                        done = done + self._requeue(lost, retry, attempts)
                        for p in lost:
                            del held[i][p]
                for answer in done:
                    held[i].pop(answer.position, None)
                    yield answer
                if on_step is not None:
                    on_step(self.progress)
                busy = {j for j, _ in pending.values()}
                for j in range(len(self.actors)):
                    if j not in busy:
                        submit(j)
                yield from refused
                refused.clear()
        finally:
            for ref in pending:
                with contextlib.suppress(Exception):  # best effort: close() ends the actors anyway
                    ray.cancel(ref)
            self.wall_time_s += time.perf_counter() - start

    def _restarted(self, i: int, instance: str) -> None:
        if instance != self.infos[i]["instance"]:
            self.restarts[i] += 1
            self.infos[i]["instance"] = instance

    def _requeue(
        self, rows: dict[int, LineRequest], retry: deque[tuple[int, LineRequest]], attempts: dict[int, int]
    ) -> list[Answer]:
        """A replica died holding ``rows``: queue them first; the ones that keep killing replicas fail."""
        again, failed = [], []
        for pos, item in sorted(rows.items()):
            attempts[pos] = attempts.get(pos, 0) + 1
            if attempts[pos] >= MAX_ATTEMPTS:
                error = item.failed(f"the replica running this line died {attempts[pos]} times")
                failed.append(Answer(pos, item.key, error))
            else:
                again.append((pos, item))
        self.rerun_rows += len(again)
        retry.extendleft(reversed(again))
        return failed

    # -- the report ------------------------------------------------------------------------------
    def _collect(self) -> None:
        from pagedinfer.ray.stats import merge, replica_rows

        if self._stats is not None or not self.actors:
            return
        stats = [self._when_up(a.stats) for a in self.actors]
        for i, a in enumerate(self.actors):  # after restarts: the live process
            info = self._when_up(a.info)
            self._restarted(i, info["instance"])
            self.infos[i] = info
        self._stats = merge(stats, self.wall_time_s)
        self.replicas = replica_rows(stats, self.infos, self.restarts)

    def _when_up(self, method, wait_s: float = 120.0):
        """``method.remote()``'s result, waiting while Ray restarts the replica."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self.ray.get(method.remote())
            except self.ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    @property
    def stats(self):
        """The merged `EngineStats` of all replicas (pools and totals summed)."""
        self._collect()
        return self._stats  # None when the replicas were lost before their figures were read

    def replica_rows(self) -> list[dict]:
        """One row of figures per replica (the report's replica table)."""
        self._collect()
        return self.replicas

    def report_dict(self) -> dict:
        """``--report-json``'s ``data_parallel`` section."""
        self._collect()
        return {
            "replicas": self.replicas,
            "ray_startup_s": round(self.startup_s, 3),
            "replicas_ready_s": round(self.ready_s, 3),
            "rows_rerun_after_restarts": self.rerun_rows,
        }

    def close(self) -> None:
        """Fetch the figures, end the actors, and stop Ray if this run started it."""
        try:
            self._collect()
        except self.ray.exceptions.RayError:
            pass
        finally:
            for a in self.actors:
                self.ray.kill(a)
            self.actors = []
            if self._started_ray:
                self.ray.shutdown()
                self._started_ray = False


def _replica_error(e: BaseException) -> str:
    """The replica's own error from a Ray actor error: its last line, without the exception's class path."""
    return re.sub(r"^[\w.]+(Error|Exception): ", "", last_line(e))

"""The Ray Data API: ``build_processor(config)(dataset)`` runs pagedinfer engines over a Dataset.

Named after vLLM's ``ray.data.llm`` processors (``model``, ``engine_kwargs``, ``concurrency``,
``batch_size``, ``accelerator_type``, ``runtime_env``, ``should_continue_on_error``). Each row is a
request in the CLI's plain-line form (``prompt`` / ``messages`` / ``prompt_token_ids``, optional
``id`` and sampling fields; other columns pass through untouched) and is validated by the line
parser ``pagedinfer run`` uses (`lines.parse`), so a row means what the same JSONL line means, seed
included. Every input row comes out, with its output columns or, under
``should_continue_on_error``, its ``error``; otherwise the first bad row fails the job with its
reason. Rows are never dropped.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedinfer.lines.line import LineError, LineRequest
from pagedinfer.lines.parse import PLAIN_FIELDS, LineParser
from pagedinfer.ray.driver import cpu_share

OUTPUT_COLUMNS = (
    "generated_text",
    "generated_tokens",
    "outputs",
    "num_input_tokens",
    "num_generated_tokens",
    "error",
)


@dataclass
class ProcessorConfig:
    """How many engines, on what, with which defaults (vLLM's names where they exist)."""

    model: str | None = None  # local directory or hub id (None: the demo model)
    engine_kwargs: dict = field(default_factory=dict)  # `pagedinfer.LLM` keyword arguments
    sampling_params: dict = field(default_factory=dict)  # defaults; a row's own fields override
    seed: int = 0  # base seed: a row without ``seed`` gets one derived from this and its id
    concurrency: int = 1  # engine replicas (an actor pool of this size)
    batch_size: int = 256  # rows per engine call: at least ``max_num_seqs`` keeps the batch full
    accelerator_type: str | None = None  # e.g. "H100": one such GPU per replica
    num_gpus_per_replica: float | None = None  # default: 1 with an accelerator_type or device "cuda"
    num_cpus_per_replica: float | None = None  # default: the CPUs split, one left for Ray Data's tasks
    runtime_env: dict | None = None
    should_continue_on_error: bool = False


class RowFailed(Exception):
    """A row could not run and ``should_continue_on_error`` is off."""


class Processor:
    """``processor(ds)`` -> a Dataset with every input row plus `OUTPUT_COLUMNS`."""

    def __init__(self, config: ProcessorConfig, preprocess: Callable | None, postprocess: Callable | None):
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess

    def __call__(self, ds):
        from pagedinfer.ray.driver import import_ray

        ray = import_ray("pagedinfer.ray.build_processor")
        from ray.data import ActorPoolStrategy

        if not ray.is_initialized():
            ray.init(include_dashboard=False)
        cpus, gpus, threads = self._resources(ray.cluster_resources())
        remote_args: dict = {"num_cpus": cpus, "num_gpus": gpus}
        if self.config.accelerator_type:
            remote_args["accelerator_type"] = self.config.accelerator_type
        if self.config.runtime_env:
            remote_args["runtime_env"] = self.config.runtime_env
        if self.preprocess is not None:
            ds = ds.map(self.preprocess)
        ds = ds.map_batches(
            EngineStage,
            fn_constructor_kwargs={"config": self.config, "threads": threads},
            batch_size=self.config.batch_size,
            batch_format="pyarrow",
            compute=ActorPoolStrategy(size=self.config.concurrency),
            **remote_args,
        )
        if self.postprocess is not None:
            ds = ds.map(self.postprocess)
        return ds

    def _resources(self, cluster: dict) -> tuple[float, float, int]:
        """(CPUs, GPUs, torch threads) per replica; CPU replicas leave one CPU to Ray Data's read tasks."""
        c = self.config
        on_gpu = bool(c.accelerator_type) or str(c.engine_kwargs.get("device", "")).startswith("cuda")
        gpus = c.num_gpus_per_replica if c.num_gpus_per_replica is not None else (1.0 if on_gpu else 0.0)
        if c.num_cpus_per_replica is not None:
            cpus = c.num_cpus_per_replica
        elif gpus:
            cpus = 1.0
        else:  # all replicas on CPUs with 2 CPUs and 2 replicas of 1 CPU each: the read task never runs
            cpus = cpu_share(max(cluster.get("CPU", 1.0) - 1.0, 0.5), c.concurrency)
        return cpus, gpus, max(1, int(cpus))


def build_processor(
    config: ProcessorConfig, preprocess: Callable | None = None, postprocess: Callable | None = None
) -> Processor:
    """A processor for ``config``; ``preprocess`` / ``postprocess`` are row functions run around it."""
    return Processor(config, preprocess, postprocess)


class EngineStage:
    """The ``map_batches`` callable class: one engine replica per actor of the pool."""

    def __init__(self, config: ProcessorConfig, threads: int) -> None:
        from pagedinfer.config import LLMConfig
        from pagedinfer.ray.actor import EngineReplica

        self.config = config
        name = config.model or "pagedinfer-demo"
        llm = LLMConfig.of(config.model, seed=config.seed, **config.engine_kwargs)
        self.replica = EngineReplica(llm, threads, name)

    def __call__(self, batch):
        import pyarrow as pa

        rows = batch.to_pylist()
        items = [row_request(row, self.config) for row in rows]
        results = {answer.position: answer.result for answer in self.replica.run_all(list(enumerate(items)))}
        if not self.config.should_continue_on_error:
            for i in sorted(results):
                if isinstance(results[i], LineError):
                    raise RowFailed(
                        f"row id={items[i].id!r}: {results[i].reason} "
                        "(should_continue_on_error=True gives such rows an 'error' column instead)"
                    )
        columns = output_columns([results[i] for i in range(len(rows))])
        for name in OUTPUT_COLUMNS:
            if name in batch.column_names:
                batch = batch.drop_columns([name])
            batch = batch.append_column(name, pa.array(columns[name], type=_output_types()[name]))
        return batch


def row_request(row: dict, config: ProcessorConfig) -> LineRequest | LineError:
    """A Dataset row as the CLI's parser sees a JSONL line (null = absent: Datasets fill missing columns).

    A row without ``id`` gets one from its content, so its derived seed does not depend on the block
    or the replica it lands in.
    """
    fields = {k: v for k, v in row.items() if k in PLAIN_FIELDS and v is not None}
    if "id" not in fields:
        digest = hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=8).hexdigest()
        fields["id"] = f"row-{digest}"
    return LineParser(config.sampling_params, config.seed, openai_file=False).parse(1, json.dumps(fields))


def output_columns(results: list[dict | LineError]) -> dict[str, list]:
    """The output columns of a batch, from the replica's records (None where a row failed)."""
    cols: dict[str, list] = {name: [] for name in OUTPUT_COLUMNS}
    for r in results:
        if isinstance(r, LineError):
            for name in OUTPUT_COLUMNS:
                cols[name].append(None)
            cols["error"][-1] = r.reason
            continue
        outs = r["outputs"]
        cols["generated_text"].append(outs[0]["text"])
        cols["generated_tokens"].append(outs[0]["token_ids"])
        cols["outputs"].append(
            [
                {"text": o["text"], "token_ids": o["token_ids"], "finish_reason": o["finish_reason"]}
                for o in outs
            ]
        )
        cols["num_input_tokens"].append(r["usage"]["prompt_tokens"])
        cols["num_generated_tokens"].append(r["usage"]["completion_tokens"])
        cols["error"].append(None)
    return cols


def _output_types() -> dict:
    import pyarrow as pa

    completion = pa.struct(
        [("text", pa.string()), ("token_ids", pa.list_(pa.int64())), ("finish_reason", pa.string())]
    )
    return {
        "generated_text": pa.string(),
        "generated_tokens": pa.list_(pa.int64()),
        "outputs": pa.list_(completion),
        "num_input_tokens": pa.int64(),
        "num_generated_tokens": pa.int64(),
        "error": pa.string(),
    }

"""What crosses the process boundary: the job a system runs, and what one timed run returns.

Both are plain frozen dataclasses (pickled into and out of each system's ``spawn`` subprocess);
every system implements the small `System` protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Beam:
    """Beam search instead of sampling: ``width`` beams returned per prompt, best first."""

    width: int
    length_penalty: float = 1.0
    early_stopping: bool = False


@dataclass(frozen=True)
class Job:
    """Everything one system needs to run one workload in one dtype."""

    model_dir: str
    dtype: str  # "float32", "bfloat16", "float16": weights and KV, for every system alike
    prompts: tuple[tuple[int, ...], ...]  # token ids
    max_tokens: tuple[int, ...]  # per prompt
    n: int  # completions per prompt (with beam search: beam.width)
    temperature: float  # 0: greedy
    seed: int
    beam: Beam | None
    threads: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    hf_batch_size: int | None  # prompts per hf_generate batch; None: all in one
    hf_cb_max_requests: int | None  # hf_generate_batch's max_requests_per_batch; None: max_num_seqs
    prefix_caching: bool | None = None  # pagedinfer's enable_prefix_caching; None: the engine's default
    device: str = "cpu"  # "cuda": every system on the GPU
    load_format: str = "auto"  # "dummy": random weights drawn on the device from the config (GPU workloads)
    max_model_len: int | None = None  # pagedinfer's; None: the model's


@dataclass
class RunResult:
    """One timed run: the tokens (``outputs[prompt][completion or beam]``), the KV figure, and details."""

    outputs: list[list[list[int]]]
    peak_kv_bytes: int
    scores: list[list[float]] | None = None  # beam search: each beam's score, as outputs
    details: dict = field(default_factory=dict)  # system-specific figures (JSON-able)
    wall_s: float = 0.0
    cpu_s: float = 0.0


class SystemUnavailable(Exception):
    """The system cannot run this job here (a missing feature); the message is one line."""


class System(Protocol):
    """A system under test. Constructed from a `Job` in its own process: loads the model and makes
    one small untimed warm-up call. ``run`` is the timed call (the whole workload); ``info`` describes
    what ran (its configuration, what its KV figure means); ``profile`` (GPU workloads) the time split
    of a few steps of an untimed run (`bench.gpu.profiled_split`)."""

    def run(self) -> RunResult: ...

    def info(self) -> dict: ...

    def profile(self) -> dict: ...

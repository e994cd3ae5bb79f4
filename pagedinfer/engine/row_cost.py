"""What a drafted row costs, first guess: steps of 1 row and of 1 + k rows timed on the loaded model
(and passes on a draft model) at start-up, the seed of speculative decoding's
`core.speculative.StepTimes` (which the run's own decode steps, or the draft's passes, then refit)."""

from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter

from pagedinfer.core.block_pool import BlockPool
from pagedinfer.core.speculative import StepTimes
from pagedinfer.model.runner import ModelRunner

TIMED = 7  # passes of each shape, alternating (their median is the seed: a loaded machine's outliers
# do not move it)


@dataclass
class Probe:
    """A sequence's rows built by hand (the runner's `ScheduledChunk`): positions ``start`` ..
    ``start + num_tokens``, every row's logits kept; token ids zeros unless given (a throwaway
    sequence on scratch blocks)."""

    block_tables: list[list[int]]  # per layer group
    num_tokens: int
    token_ids: list[int] = field(default_factory=list)
    lora_slot: int = 0
    start: int = 0

    def __post_init__(self) -> None:
        self.token_ids = self.token_ids or [0] * (self.start + self.num_tokens)

    @property
    def seq(self) -> Probe:
        return self

    @property
    def num_logits(self) -> int:
        return self.num_tokens

    @property
    def step_token_ids(self) -> list[int]:
        return self.token_ids[self.start : self.start + self.num_tokens]


def measure_step_times(runner: ModelRunner, pool: BlockPool, k: int) -> StepTimes:
    """Time steps of 1 and ``1 + k`` rows (positions from 0, on blocks taken from ``pool`` and given
    back). No free block for them: no times (every draft is taken until the run's steps time two row
    counts)."""
    tables: list[list[int]] = [[] for _ in range(pool.num_groups)]
    try:
        if len(tables) * pool.blocks_for_tokens(1 + k) > pool.num_free:
            return StepTimes()
        for g, table in enumerate(tables):
            pool.reserve(table, 0, 1 + k, g)
        times: dict[int, list[float]] = {1: [], 1 + k: []}
        one, many = [Probe(tables, 1)], [Probe(tables, 1 + k)]
        for i in range(TIMED + 1):  # the first pass of each shape warms up, untimed
            for batch in (one, many):
                t = perf_counter()
                runner.execute(batch, [])
                if i:
                    times[batch[0].num_tokens].append(perf_counter() - t)
    finally:
        for table in tables:
            pool.free(table)
    return StepTimes(times)

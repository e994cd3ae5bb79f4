"""What a drafted row costs: one step of 1 row and one of 1 + k rows timed on the loaded model at
start-up (speculative decoding's gate, `core.speculative.RowCost`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter

from pagedinfer.core.block_pool import BlockPool
from pagedinfer.core.speculative import RowCost
from pagedinfer.model.runner import ModelRunner

TIMED = 5  # passes of each shape, alternating (the least of each kept: a loaded machine only adds)


@dataclass
class _Probe:
    """A throwaway sequence on scratch blocks (the runner's `ScheduledChunk`)."""

    block_tables: list[list[int]]  # per layer group
    num_tokens: int
    token_ids: list[int] = field(default_factory=list)
    lora_slot: int = 0
    start: int = 0

    def __post_init__(self) -> None:
        self.token_ids = [0] * self.num_tokens

    @property
    def seq(self) -> _Probe:
        return self

    @property
    def num_logits(self) -> int:
        return self.num_tokens

    @property
    def step_token_ids(self) -> list[int]:
        return self.token_ids


def measure_row_cost(runner: ModelRunner, pool: BlockPool, k: int) -> RowCost:
    """Time steps of 1 and ``1 + k`` rows (positions from 0, on blocks taken from ``pool`` and given
    back); fit ``fixed + per_row * rows``. No free block for them: rows assumed free (always draft)."""
    tables: list[list[int]] = [[] for _ in range(pool.num_groups)]
    try:
        if len(tables) * pool.blocks_for_tokens(1 + k) > pool.num_free:
            return RowCost(float("inf"))
        for g, table in enumerate(tables):
            pool.reserve(table, 0, 1 + k, g)
        one, many = [_Probe(tables, 1)], [_Probe(tables, 1 + k)]
        best = {1: float("inf"), 1 + k: float("inf")}
        for i in range(TIMED + 1):  # the first pass of each shape warms up, untimed
            for batch in (one, many):
                t = perf_counter()
                runner.execute(batch, [])
                if i:
                    best[batch[0].num_tokens] = min(best[batch[0].num_tokens], perf_counter() - t)
    finally:
        for table in tables:
            pool.free(table)
    per_row = max((best[1 + k] - best[1]) / k, best[1] * 1e-3)  # timing noise never makes rows free
    return RowCost(max(best[1] - per_row, 0.0) / per_row)

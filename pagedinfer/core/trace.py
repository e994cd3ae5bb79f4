"""The step-by-step record behind `pagedinfer blocks`: typed pool events and one snapshot per step.

The schema lives here only: the engine appends `snapshot(...)` dicts, the CLI saves them as JSON and
draws them. A snapshot's keys: ``step``, ``scheduled`` (seq, start, tokens), ``copies`` ([src, dst]),
``preempted`` (request ids), ``events`` (`BlockEvent` fields), ``ref_counts`` and ``filled`` (per
block in use), ``cached`` (cached blocks nobody references, least recently used first), ``tables``
(seq name -> physical blocks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pagedinfer.core.block_pool import BlockPool
    from pagedinfer.core.scheduler import SchedulerOutput
    from pagedinfer.core.sequence import Request

# prefix cache: "hit" (a cached block handed to a new prompt), "cached" (its last reference dropped,
# the block stays cached and evictable), "evict" (a cached block reclaimed for new contents)
EventKind = Literal["alloc", "free", "cow", "fork", "hit", "cached", "evict"]


@dataclass
class BlockEvent:
    """One pool change, recorded only when tracing."""

    kind: EventKind
    block: int  # the block allocated, freed or written by the copy; for "fork" the table's last block
    src: int | None = None  # for "cow": the shared block that was copied
    table: list[int] | None = None  # for "fork": the table the child shares


def snapshot(step: int, plan: SchedulerOutput, pool: BlockPool, running: list[Request]) -> dict:
    """One step of the trace: scheduled work, pool events, every block's count, every table."""
    return {
        "step": step,
        "scheduled": [{"seq": s.seq.name, "start": s.start, "tokens": s.num_tokens} for s in plan.batch],
        "copies": [list(c) for c in plan.copies],
        "preempted": [r.request_id for r in plan.preempted],
        "events": [asdict(e) for e in pool.events or []],
        "ref_counts": {b: c for b, c in enumerate(pool.ref_counts[: pool.num_blocks]) if c},
        "filled": {b: f for b, f in enumerate(pool.filled[: pool.num_blocks]) if pool.ref_counts[b]},
        "cached": list(pool.evictable),
        "tables": {s.name: list(s.block_table) for r in running for s in r.live_seqs()},
    }

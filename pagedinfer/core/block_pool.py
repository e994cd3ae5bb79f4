"""The fixed pool of physical KV blocks: free list, reference counts, and per-sequence block tables.

A block table is a plain ``list[int]`` of physical block ids, one per logical block (L0, L1, ...).
Token position ``p`` lives in physical block ``table[p // block_size]`` at slot ``p % block_size``.
Blocks are handed out on demand (only when the last block is full), shared by ``fork`` (reference
counts rise), and copied only when a sequence must *write* into a block that others still
reference (copy-on-write); a full shared block is never written again, so it stays shared.

All allocation and release goes through ``_take`` / ``_release``, so hash-based reuse of full
prompt blocks across requests can later be added there (a hash -> block map consulted before
taking a free block, and freed hashed blocks parked in an evictable LRU instead of the free list).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedinfer.core.trace import BlockEvent, EventKind


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a write needs; the scheduler preempts and retries."""


@dataclass
class BlockPool:
    num_blocks: int
    block_size: int
    ref_counts: list[int] = field(init=False)
    filled: list[int] = field(init=False)  # slots of each block holding K/V (fragmentation stats)
    free_ids: list[int] = field(init=False)  # a stack: the most recently freed block is reused first
    num_filled_slots: int = field(init=False, default=0)
    num_cow_copies: int = field(init=False, default=0)
    events: list[BlockEvent] | None = field(init=False, default=None)  # set to [] to trace

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("the KV pool needs at least one block of at least one slot")
        self.ref_counts = [0] * self.num_blocks
        self.filled = [0] * self.num_blocks
        self.free_ids = list(range(self.num_blocks - 1, -1, -1))  # P0 is handed out first

    # -- counts ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, table: list[int], start: int, num_tokens: int) -> int:
        """New blocks that writing positions [start, start + num_tokens) into ``table`` takes."""
        new = self.blocks_for_tokens(start + num_tokens) - len(table)
        if start % self.block_size and self.ref_counts[table[start // self.block_size]] > 1:
            new += 1  # the partly filled shared block must be copied before it is written
        return max(new, 0)

    # -- allocation -----------------------------------------------------------------------
    def _take(self) -> int:
        if not self.free_ids:
            raise OutOfBlocks("no free KV block")
        block = self.free_ids.pop()  # LIFO keeps the touched memory (RSS) near the peak in use
        self.ref_counts[block] = 1
        self._trace("alloc", block)
        return block

    def _release(self, block: int) -> None:
        count = self.ref_counts[block]
        if count <= 0:
            raise AssertionError(f"block {block} freed twice")
        self.ref_counts[block] = count - 1
        if count == 1:
            self.num_filled_slots -= self.filled[block]
            self.filled[block] = 0
            self.free_ids.append(block)
            self._trace("free", block)

    def reserve(self, table: list[int], start: int, num_tokens: int) -> list[tuple[int, int]]:
        """Make ``table`` ready for K/V at positions [start, start + num_tokens): the slots, not the K/V.

        Allocates missing blocks and copies a shared, partly filled first block (copy-on-write).
        Returns the (src, dst) block copies the KV tensors must perform before the write.
        Raises OutOfBlocks, changing nothing, when the pool cannot cover the write.
        """
        if num_tokens <= 0:
            return []
        needed = self.blocks_needed(table, start, num_tokens)
        if needed > len(self.free_ids):
            raise OutOfBlocks(f"need {needed} blocks, {len(self.free_ids)} free")
        bs = self.block_size
        copies = []
        first = start // bs
        if start % bs and self.ref_counts[table[first]] > 1:
            src = table[first]
            dst = self._take()
            self.filled[dst] = start % bs  # the copied prefix is this sequence's own K/V
            self.num_filled_slots += start % bs
            self._release(src)
            table[first] = dst
            copies.append((src, dst))
            self.num_cow_copies += 1
            self._trace("cow", dst, src)
        end = start + num_tokens
        last = self.blocks_for_tokens(end)
        while len(table) < last:
            table.append(self._take())
        for logical in range(first, last):
            block = table[logical]
            now = min(bs, end - logical * bs)
            if now > self.filled[block]:
                self.num_filled_slots += now - self.filled[block]
                self.filled[block] = now
        return copies

    def fork(self, table: list[int]) -> list[int]:
        """A child table pointing at the same physical blocks (every count rises by one)."""
        for block in table:
            self.ref_counts[block] += 1
        self._trace("fork", table[-1] if table else -1, table=list(table))
        return list(table)

    def free(self, table: list[int]) -> None:
        """Drop a sequence's references; blocks nobody references return to the free list."""
        for block in reversed(table):
            self._release(block)
        table.clear()

    def slot(self, table: list[int], position: int) -> int:
        """Flat slot index (block * block_size + offset) of a token position: the seeds' lookup."""
        block, offset = divmod(position, self.block_size)
        return table[block] * self.block_size + offset

    def _trace(
        self, kind: EventKind, block: int, src: int | None = None, table: list[int] | None = None
    ) -> None:
        if self.events is not None:
            self.events.append(BlockEvent(kind, block, src, table))

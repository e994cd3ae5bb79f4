"""The fixed pool of physical KV blocks: free list, reference counts, block tables, prefix cache.

A block table is a plain ``list[int]`` of physical block ids, one per logical block (L0, L1, ...).
Token position ``p`` lives in physical block ``table[p // block_size]`` at slot ``p % block_size``.
Blocks are handed out on demand (only when the last block is full), shared by ``fork`` (reference
counts rise), and copied only when a sequence must *write* into a block that others still
reference (copy-on-write); a full shared block is never written again, so it stays shared.

Prefix caching (across requests): every FULL, computed block is named by a
chained hash of its parent's hash and its own token ids, so equal hashes mean equal token
prefixes and therefore equal K/V. A new sequence is handed the blocks of its longest cached prefix
(``cached_prefix`` finds them, ``acquire`` takes them, ``count_hit`` counts the hit, as the KV-cache
manager's lookup and admission call them): counts rise, nothing is computed again. A hashed block
whose count falls to zero is not freed: it stays cached and evictable, least recently used first,
and is only reclaimed when no never-cached free block is left. A cached block is therefore never handed out while
referenced, and a full block is never written, so its hash always matches its tokens. When a hash
leaves the cache, ``on_uncache`` is told (the KV-cache manager drops what it kept beside it).

The hash is a 256-bit BLAKE2b digest of (parent digest, token ids): an accidental collision among
even 2**64 distinct blocks has a probability near 2**-128, and crafting one means breaking BLAKE2b,
so stored token ids are not kept or compared.

All allocation and release goes through ``_take`` / ``_release``. Which sequence gets which blocks,
and when, is decided above the pool (`core.kv_cache_manager`).

Layer groups (`attention.kv_cache.group_layers`) share the pool: each block is taken for one group
(``group_of``, counted in ``used_by_group``), and each group's tables and hash chains are its own. A
pool serving a windowed group has one block more, the null block (``null_block``, id ``num_blocks``):
it stands in a table for a block the window released (`release_before`), holds one permanent
reference (so tables fork and free it like any block, and it is never free, hashed or counted used).

A speculative draft model's K/V live in the same blocks (`engine.draft_model`): a block id holds the
target's layers and the draft's, so one reference count, copy-on-write and prefix-cache entry serve
both. The draft computes lazily, so a block also says how many of its leading slots hold the draft's
K/V (``draft_filled``): what was computed from the tokens the block holds. A block taken anew holds
none (a copy-on-write copy included: the draft's slots are computed again, not copied), `truncate`
cuts them with the target's, and a cached block keeps them for the requests that hit it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedinfer.core.trace import BlockEvent, EventKind


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a write needs (nothing was changed)."""


def block_hashes(token_ids: list[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """Chained digests of the full blocks of ``token_ids``: block i's covers tokens [0, (i+1) * block_size)."""
    out = []
    for i in range(len(token_ids) // block_size):
        parent = _chain(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def _chain(parent: bytes, tokens: list[int]) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=32)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


@dataclass
class BlockPool:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    on_uncache: Callable[[bytes], None] | None = None  # told each hash that leaves the cache
    ref_counts: list[int] = field(init=False)
    filled: list[int] = field(init=False)  # slots of each block holding K/V (fragmentation stats)
    draft_filled: list[int] = field(init=False)  # leading slots of each block holding the draft model's K/V
    free_ids: list[int] = field(init=False)  # never-cached free blocks, a stack: last freed, first reused
    hashes: list[bytes | None] = field(init=False)  # chained hash of each full computed block, else None
    cached: dict[bytes, int] = field(init=False)  # hash -> the block that serves hits for it
    evictable: OrderedDict[int, None] = field(init=False)  # cached, unreferenced; least recently used first
    num_filled_slots: int = field(init=False, default=0)  # filled slots of referenced blocks
    num_cow_copies: int = field(init=False, default=0)
    prefix_queries: int = field(init=False, default=0)  # prompt tokens looked up in the cache
    prefix_hits: int = field(init=False, default=0)  # of those, tokens whose computation the cache saved
    blocks_reused: int = field(init=False, default=0)  # blocks handed out by a hit
    evictions: int = field(init=False, default=0)  # cached blocks reclaimed for other contents
    events: list[BlockEvent] | None = field(init=False, default=None)  # set to [] to trace
    num_groups: int = 1  # layer groups taking blocks from the pool
    with_null_block: bool = False  # one block more: the null block of windowed tables
    null_block: int | None = field(init=False, default=None)
    group_of: list[int] = field(init=False)  # the group each block was last taken for
    used_by_group: list[int] = field(init=False)  # referenced blocks per group
    peak_by_group: list[int] = field(init=False)  # the most referenced at once per group (`reset_peaks`)
    window_releases: int = field(init=False, default=0)  # references windows dropped (`release_before`)

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("the KV pool needs at least one block of at least one slot")
        total = self.num_blocks + int(self.with_null_block)
        self.ref_counts = [0] * total
        self.filled = [0] * total
        self.draft_filled = [0] * total
        self.free_ids = list(range(self.num_blocks - 1, -1, -1))  # P0 is handed out first
        self.hashes = [None] * total
        self.cached = {}
        self.evictable = OrderedDict()
        self.group_of = [0] * total
        self.used_by_group = [0] * self.num_groups
        self.peak_by_group = [0] * self.num_groups
        if self.with_null_block:
            self.null_block = self.num_blocks
            self.ref_counts[self.null_block] = 1  # the pool's own: never released

    # -- counts ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks a write can take: never-cached free ones plus evictable cached ones."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used(self) -> int:
        """Blocks some sequence references."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Cached blocks nobody references (free to evict, kept for future hits)."""
        return len(self.evictable)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, table: list[int], start: int, num_tokens: int) -> int:
        """New blocks that writing positions [start, start + num_tokens) into ``table`` takes."""
        new = self.blocks_for_tokens(start + num_tokens) - len(table)
        if start % self.block_size and self.ref_counts[table[start // self.block_size]] > 1:
            new += 1  # the partly filled shared block must be copied before it is written
        return max(new, 0)

    # -- allocation -----------------------------------------------------------------------
    def _take(self, group: int = 0) -> int:
        if self.free_ids:
            block = self.free_ids.pop()  # LIFO keeps the touched memory (RSS) near the peak in use
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)  # the least recently used cached block
            self._uncache(block)
            self.evictions += 1
            self._trace("evict", block)
        else:
            raise OutOfBlocks("no free KV block")
        self.ref_counts[block] = 1
        self.draft_filled[block] = 0
        self.group_of[block] = group
        self._count_used(group, 1)
        self._trace("alloc", block)
        return block

    def _count_used(self, group: int, change: int) -> None:
        used = self.used_by_group[group] = self.used_by_group[group] + change
        if used > self.peak_by_group[group]:
            self.peak_by_group[group] = used

    def reset_peaks(self) -> None:
        """Start each group's peak from its use now."""
        self.peak_by_group = list(self.used_by_group)

    def _release(self, block: int) -> None:
        count = self.ref_counts[block]
        if count <= 0:
            raise AssertionError(f"block {block} freed twice")
        self.ref_counts[block] = count - 1
        if count == 1:
            self.num_filled_slots -= self.filled[block]
            self._count_used(self.group_of[block], -1)
            digest = self.hashes[block]
            # a duplicate whose original was evicted takes over the hash
            if digest is not None and self.cached.setdefault(digest, block) == block:
                self.evictable[block] = None  # kept with its K/V, most recently used last
                self._trace("cached", block)
            else:
                self._uncache(block)
                self.free_ids.append(block)
                self._trace("free", block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached, unreferenced block (they become free); blocks in use keep their hashes."""
        while self.evictable:
            block, _ = self.evictable.popitem()
            self._uncache(block)
            self.free_ids.append(block)

    def _uncache(self, block: int) -> None:
        digest = self.hashes[block]
        if digest is not None and self.cached.get(digest) == block:
            del self.cached[digest]
            if self.on_uncache is not None:
                self.on_uncache(digest)
        self.hashes[block] = None
        self.filled[block] = 0

    def reserve(self, table: list[int], start: int, num_tokens: int, group: int = 0) -> list[tuple[int, int]]:
        """Make ``table`` ready for K/V at positions [start, start + num_tokens): the slots, not the K/V.

        Allocates missing blocks and copies a shared, partly filled first block (copy-on-write).
        Returns the (src, dst) block copies the KV tensors must perform before the write.
        Raises OutOfBlocks, changing nothing, when the pool cannot cover the write. New blocks are
        ``group``'s.
        """
        if num_tokens <= 0:
            return []
        needed = self.blocks_needed(table, start, num_tokens)
        if needed > self.num_free:
            raise OutOfBlocks(f"need {needed} blocks, {self.num_free} free")
        bs = self.block_size
        copies = []
        first = start // bs
        if start % bs and self.ref_counts[table[first]] > 1:
            src = table[first]
            dst = self._take(group)
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
            table.append(self._take(group))
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
        """Drop a sequence's references; blocks nobody references return to the free list or the cache.

        Released last block first, so a cached chain's tail is evicted before its head (which more
        prompts share).
        """
        for block in reversed(table):
            self._release(block)
        table.clear()

    def truncate(self, table: list[int], num_tokens: int) -> None:
        """Shorten a sequence to its first ``num_tokens`` positions (rejected drafted tokens): the blocks
        past them are released, the last kept block's filled slots cut. Those slots were never hashed
        (`register_full_blocks` reads computed positions only)."""
        keep = self.blocks_for_tokens(num_tokens)
        for block in reversed(table[keep:]):
            self._release(block)
        del table[keep:]
        if keep:
            last, now = table[-1], num_tokens - (keep - 1) * self.block_size
            if self.filled[last] > now:
                self.num_filled_slots -= self.filled[last] - now
                self.filled[last] = now
            self.draft_filled[last] = min(self.draft_filled[last], now)

    def release_before(self, table: list[int], num_blocks: int) -> None:
        """Release ``table``'s first ``num_blocks`` blocks (a window has left them): each entry becomes
        the null block. Released from the last, stopping at one released before (they go in order)."""
        null = self.null_block
        i = min(num_blocks, len(table)) - 1
        while i >= 0 and table[i] != null:
            self._release(table[i])
            table[i] = null
            self.ref_counts[null] += 1
            self.window_releases += 1
            i -= 1

    # -- the draft model's K/V ------------------------------------------------------------
    def draft_computed(self, table: list[int]) -> int:
        """How many leading positions of ``table`` hold the draft model's K/V."""
        n = 0
        for block in table:
            held = self.draft_filled[block]
            n += held
            if held < self.block_size:
                break
        return n

    def hold_draft(self, table: list[int], start: int, end: int) -> None:
        """The draft model wrote its K/V at positions [start, end) of ``table``, ``start`` being
        `draft_computed`: those slots count as held."""
        bs = self.block_size
        for logical in range(start // bs, -(-end // bs)):
            self.draft_filled[table[logical]] = min(bs, end - logical * bs)

    # -- prefix cache ---------------------------------------------------------------------
    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of a sequence with these block hashes (no change)."""
        blocks = []
        if self.enable_prefix_caching:
            for digest in hashes:
                block = self.cached.get(digest)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference to each of ``blocks`` (cached ones, or the null block), reviving the
        unreferenced from the evictable set."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
                self.num_filled_slots += self.filled[block]
                self._count_used(self.group_of[block], 1)
            self.ref_counts[block] += 1
            if block != self.null_block:
                self._trace("hit", block)

    def count_hit(self, num_tokens: int, num_hit_blocks: int, num_reused: int, prompt: bool = True) -> None:
        """Count a hit of ``num_hit_blocks`` leading blocks of a sequence of ``num_tokens`` tokens, served by
        ``num_reused`` cached blocks (fewer where a window needs not all); ``prompt=False`` (a resumed
        completion) leaves the prompt-token counts alone. The last token is always computed."""
        if prompt:
            self.prefix_queries += num_tokens
            self.prefix_hits += min(num_hit_blocks * self.block_size, num_tokens - 1)
        self.blocks_reused += num_reused

    def register_full_blocks(
        self, table: list[int], token_ids: list[int], num_computed: int, seed: bytes = b""
    ) -> None:
        """Hash the blocks of ``table`` that are full and computed (positions < ``num_computed``), the
        chain starting from ``seed`` (`kv_cache_manager.chain_seed`).

        Called after each step; blocks hashed before are skipped. A block whose contents are cached
        already in another block keeps its hash (for the chain) but stays out of the map. Where the
        last hashed block before them is a released one (the null block), the chain is lost: nothing
        more of the table is hashed.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(num_computed // bs, len(table))
        first = full
        while first > 0 and self.hashes[table[first - 1]] is None:
            if table[first - 1] == self.null_block:
                return
            first -= 1
        parent = self.hashes[table[first - 1]] if first else seed
        for logical in range(first, full):
            block = table[logical]
            parent = _chain(parent, token_ids[logical * bs : (logical + 1) * bs])
            self.hashes[block] = parent
            self.cached.setdefault(parent, block)

    def slot(self, table: list[int], position: int) -> int:
        """Flat slot index (block * block_size + offset) of a token position (the block-table lookup)."""
        block, offset = divmod(position, self.block_size)
        return table[block] * self.block_size + offset

    def _trace(
        self, kind: EventKind, block: int, src: int | None = None, table: list[int] | None = None
    ) -> None:
        if self.events is not None:
            self.events.append(BlockEvent(kind, block, src, table))

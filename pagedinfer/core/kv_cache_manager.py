"""The KV-cache manager: which physical blocks hold each sequence's K/V, and which are worth keeping
(vLLM v1's ``KVCacheManager``).

It owns the `BlockPool` and decides every use of it:

* a new prompt starts from its longest cached prefix (`lookup`, `can_admit`, `take_prefix`);
* a write gets its slots on demand, one block when the last one is full, and a shared partly filled
  block is copied first (copy-on-write; `allocate` answers None, changing nothing, when the free
  blocks cannot cover it: the scheduler then preempts);
* once a prompt is computed, its completions share every prompt block, the partly filled last one
  included, or a completion resumed after a preemption takes its own cached blocks back
  (`fork_prompt`); a beam search's child shares its parent's blocks (`fork`);
* a sequence that ends gives its references back (`free`); a block nobody references stays cached;
* a sequence whose drafted tokens were rejected is cut back to its verified positions (`truncate`):
  drafts are written and verified within one step, so no block holding unverified tokens is ever
  hashed or shared with a fork.

Full computed blocks are named by chained hashes (`cache_blocks`) whose chain starts from the
request's adapter (`chain_seed`), and a prompt's logprobs are kept beside its cached blocks, so a
later request with the same prefix takes them with the blocks (`keep_prompt_logprobs`,
`cached_prompt_logprobs`).

It changes block tables, reference counts and the cache only: a sequence's tokens and computed
count are the scheduler's.

Layer groups (`attention.kv_cache.group_layers`, vLLM v1's hybrid KV-cache manager): each sequence
holds one block table per group (``Sequence.block_tables``), all from the one pool, and every rule
above holds per group: allocation, copy-on-write, forks, truncation, and the prefix cache, whose hash
chains start from a seed of their group's own (a block's K/V are its group's layers'). A windowed
group's table gives back a block once no position still to compute can read it (`allocate`: the
block lies wholly before ``num_computed - window + 1``); the entry then names the pool's null block.
A block shared by forks is freed when the last of them has released it (reference counts). A prefix
hit of ``m`` blocks needs, in a windowed group, only the blocks its window reads from the first
position computed after the hit, so released ones need not be cached; the hit is the longest ``m``
every group can serve (vLLM's rule). Admission counts each group's blocks for the whole prompt.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedinfer.core.block_pool import BlockPool, block_hashes

if TYPE_CHECKING:
    from pagedinfer.core.sequence import Request, Sequence
    from pagedinfer.outputs import Logprob


@functools.lru_cache(maxsize=4096)
def chain_seed(adapter_digest: bytes) -> bytes:
    """The parent of a sequence's first block hash: K/V computed under an adapter is that adapter's own,
    so each adapter starts its own chains from its digest (what it computes with, not the slot it
    holds now: slots change hands); the base model's (``b""``) is the empty seed."""
    return b"" if not adapter_digest else hashlib.blake2b(b"lora:" + adapter_digest, digest_size=32).digest()


@dataclass(frozen=True)
class KVCacheBlocks:
    """What one `allocate` gave a sequence: the blocks appended to its table, and the copies to make
    before the step writes (each ``dst`` has replaced the shared ``src`` in the table)."""

    new_blocks: tuple[int, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()  # (src, dst)


NO_NEW_BLOCKS = KVCacheBlocks()  # most decode tokens fit the last block: one answer for all of them


@dataclass
class PrefixHit:
    """A waiting request's cached prompt prefix, looked up: nothing is taken yet."""

    hashes: list[bytes]  # the full prompt blocks it may hit (with prompt logprobs: those they are kept for)
    blocks: list[int]  # the cached blocks of the first ``len(blocks)`` hashes (the first group's)
    num_computed: int  # prompt positions whose K/V it saves computing
    # every group's hit blocks, ``blocks`` first (a windowed group's: the null block where its window
    # needs none); empty: one group
    tables: list[list[int]] = field(default_factory=list)

    @property
    def next_hash(self) -> bytes | None:
        """The hash of the first full prompt block not cached (None: none is left)."""
        return self.hashes[len(self.blocks)] if len(self.blocks) < len(self.hashes) else None


@dataclass
class KVCacheStats:
    """The manager's snapshot: the pool's use now, and its counts since the last `reset_stats`
    (``group_*``: per layer group, in `KVCacheManager.windows` order)."""

    num_used_blocks: int = 0  # referenced by some sequence
    num_filled_slots: int = 0  # slots of those blocks holding K/V
    num_cached_blocks: int = 0  # cached, referenced by none (evictable)
    cow_copies: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the cache
    prefix_hits: int = 0  # of those, tokens whose computation the cache saved
    blocks_reused: int = 0  # blocks handed to a new sequence by a hit
    evictions: int = 0  # cached blocks reclaimed for other contents
    window_releases: int = 0  # table entries windows gave back before their sequences ended
    group_used_blocks: tuple[int, ...] = ()  # referenced per group now
    group_peak_blocks: tuple[int, ...] = ()  # the most referenced at once per group since `reset_stats`


COUNTS = ("cow_copies", "prefix_queries", "prefix_hits", "blocks_reused", "evictions", "window_releases")


@functools.lru_cache(maxsize=4096)
def _group_seed(seed: bytes, group: int) -> bytes:
    """The hash-chain seed of layer group ``group``: the first group's is ``seed`` itself. Cached with
    `chain_seed`: `cache_blocks` asks for every sequence's seeds in every group after every step, from
    a handful of adapters and groups."""
    return seed if not group else hashlib.blake2b(b"group:%d:" % group + seed, digest_size=32).digest()


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        windows: tuple[int, ...] = (0,),
    ) -> None:
        """``windows``: each layer group's attention window in tokens (0: the whole context), in the
        order of ``Sequence.block_tables``."""
        self.windows = tuple(windows)
        self.pool = BlockPool(
            num_blocks,
            block_size,
            enable_prefix_caching,
            on_uncache=self._uncached,
            num_groups=len(self.windows),
            with_null_block=any(self.windows),
        )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._windowed = [(g, w) for g, w in enumerate(self.windows) if w]
        # hash -> (k, the prompt logprobs of the block's tokens with their top k): kept while it is cached
        self._prompt_logprobs: dict[bytes, tuple[int, list]] = {}
        self._counts_at_reset = self._counts()

    # -- a new prompt -----------------------------------------------------------------------
    def prompt_hashes(self, req: Request, group: int = 0) -> list[bytes]:
        """The chained hashes of ``req``'s full prompt blocks in layer group ``group`` (made once, kept
        on the request)."""
        if group not in req.prompt_hashes:
            seed = _group_seed(chain_seed(req.adapter_digest), group)
            req.prompt_hashes[group] = block_hashes(req.prompt_token_ids, self.block_size, seed)
        return req.prompt_hashes[group]

    def num_cached_blocks(self, req: Request) -> int:
        """How many of ``req``'s full prompt blocks are cached now, from the first (the first group's)."""
        return len(self.pool.cached_prefix(self.prompt_hashes(req)))

    def lookup(self, req: Request) -> PrefixHit:
        """``req``'s longest cached prompt prefix. With prompt logprobs still to fill, only blocks whose
        logprobs are kept count, and the last cached position is computed again: its logits give the
        first uncached token's entry. A fully cached prompt still computes its last token (its logits
        are sampled)."""
        hashes = self.prompt_hashes(req) if self.enable_prefix_caching else []
        if req.needs_prompt_logprobs:
            hashes = hashes[: self._prompt_logprobs_prefix(hashes, req.params.prompt_logprobs)]
        num_tokens, bs = req.num_prompt_tokens, self.block_size

        def computed(m: int) -> int:  # positions a hit of m blocks saves computing
            cached = m * bs
            return min(cached, num_tokens - 1) - (req.needs_prompt_logprobs and 0 < cached < num_tokens)

        tables = self._longest_hit(lambda g: self.prompt_hashes(req, g), len(hashes), computed)
        return PrefixHit(hashes, tables[0], computed(len(tables[0])), tables)

    def _longest_hit(
        self, hashes: Callable[[int], list[bytes]], upto: int, computed: Callable[[int], int]
    ) -> list[list[int]]:
        """Each group's blocks for the longest prefix of at most ``upto`` full blocks that every group
        serves from the cache (``hashes``: a group's chain; ``computed``: the positions a hit of m
        blocks leaves computed). A global group needs all m blocks; a windowed one those its window
        reads from position ``computed(m)`` on, the null block before them."""
        pool = self.pool
        if not upto:
            return [[] for _ in self.windows]
        m = len(pool.cached_prefix(hashes(0)[:upto])) if not self.windows[0] else upto
        for g, w in enumerate(self.windows):
            if not w and g:
                m = min(m, len(pool.cached_prefix(hashes(g)[:m])))
        if not self._windowed:
            return [pool.cached_prefix(hashes(g)[:m]) for g in range(len(self.windows))]
        while m > 0 and self.enable_prefix_caching:
            tables = []
            for g, w in enumerate(self.windows):
                first = max(0, computed(m) - w + 1) // self.block_size if w else 0
                blocks = [pool.cached.get(h) for h in hashes(g)[first:m]]
                if None in blocks:
                    break
                tables.append([pool.null_block] * first + blocks)
            else:
                return tables
            m -= 1
        return [[] for _ in self.windows]

    def can_admit(self, req: Request, hit: PrefixHit) -> bool:
        """Whether the free blocks cover ``req``'s whole prompt started from ``hit``, in every group: the
        blocks still to allocate, the hit blocks that leave the evictable set, and the copy of the last
        hit block when it is written (`PrefixHit.num_computed` falls inside it) while another sequence
        holds it."""
        pool, need = self.pool, 0
        for blocks in hit.tables:
            need += pool.blocks_for_tokens(req.num_prompt_tokens) - len(blocks)
            need += sum(pool.ref_counts[b] == 0 for b in blocks)
            need += hit.num_computed < len(blocks) * self.block_size and pool.ref_counts[blocks[-1]] > 0
        return need <= pool.num_free

    def take_prefix(self, seq: Sequence, hit: PrefixHit) -> None:
        """Start ``seq`` (a request's prompt, its tables empty) from ``hit``: a reference to each hit block."""
        seq.block_tables = self._take_hit(hit.tables, len(seq.token_ids), prompt=True)

    def _take_hit(self, tables: list[list[int]], num_tokens: int, prompt: bool) -> list[list[int]]:
        """A reference to each block of ``tables`` (a hit), counted; returns them as new tables."""
        if self.enable_prefix_caching:
            for blocks in tables:
                self.pool.acquire(blocks)
            reused = sum(b != self.pool.null_block for blocks in tables for b in blocks)
            self.pool.count_hit(num_tokens, len(tables[0]), reused, prompt)
        return [list(blocks) for blocks in tables]

    def cached_prompt_logprobs(self, req: Request, hit: PrefixHit) -> list[dict[int, Logprob] | None]:
        """The prompt logprobs kept beside ``hit``'s blocks, one entry per position they hold, each cut
        to ``req``'s top k (the position's own token kept)."""
        bs, k = self.block_size, req.params.prompt_logprobs
        out: list[dict[int, Logprob] | None] = []
        for b, digest in enumerate(hit.hashes[: len(hit.blocks)]):
            for j, entry in enumerate(self._prompt_logprobs[digest][1]):
                token = req.prompt_token_ids[b * bs + j]
                out.append(
                    None
                    if entry is None
                    else {t: lp for t, lp in entry.items() if lp.rank <= k or t == token}
                )
        return out

    # -- slots ------------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> KVCacheBlocks | None:
        """Slots for ``seq``'s next ``num_new_tokens`` positions (from ``seq.num_computed``) in every
        group: new blocks as its tables need them, and a copy of a shared partly filled block before
        it is written. None when the free blocks cannot cover them; nothing is changed then but the
        release of blocks the windows have left (no position still to compute reads them)."""
        pool, tables, start = self.pool, seq.block_tables, seq.num_computed
        for g, w in self._windowed:  # first, so their blocks serve this write
            pool.release_before(tables[g], max(0, start - w + 1) // self.block_size)
        if sum(pool.blocks_needed(t, start, num_new_tokens) for t in tables) > pool.num_free:
            return None
        before = [len(t) for t in tables]
        copies = []
        for g, table in enumerate(tables):
            copies += pool.reserve(table, start, num_new_tokens, g)
        new = tuple(b for table, n in zip(tables, before, strict=True) for b in table[n:])
        if not copies and not new:
            return NO_NEW_BLOCKS
        return KVCacheBlocks(new, tuple(copies))

    def fork_prompt(self, prompt: Sequence, seq: Sequence) -> int:
        """Give completion ``seq`` its blocks once its request's ``prompt`` is computed; returns how many
        of its positions they hold K/V for.

        A completion resumed after a preemption takes its own longest cached prefix when that reaches
        past the prompt's full blocks: the full blocks of its generated tokens were cached before the
        preemption and, unless evicted since, are not computed again. Any other shares the prompt's
        blocks, the partly filled last one included (reference counts rise, nothing is copied).
        """
        bs, n = self.block_size, len(seq.token_ids)
        if seq.num_output_tokens and self.enable_prefix_caching:
            seed = chain_seed(seq.request.adapter_digest)

            @functools.cache
            def hashes(g: int) -> list[bytes]:
                return block_hashes(seq.token_ids, bs, _group_seed(seed, g))

            tables = self._longest_hit(hashes, n // bs, lambda m: min(m * bs, n - 1))
            if len(tables[0]) > seq.num_prompt_tokens // bs:
                seq.block_tables = self._take_hit(tables, n, prompt=False)
                return min(len(tables[0]) * bs, n - 1)
        seq.block_tables = [self.pool.fork(t) for t in prompt.block_tables]
        return prompt.num_computed

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (a beam) shares every block of ``parent``; a shared partly filled block is copied
        when one of them first writes it."""
        child.block_tables = [self.pool.fork(t) for t in parent.block_tables]

    def num_table_blocks(self, seq: Sequence) -> int:
        """Entries of ``seq``'s tables naming a block (the null block, standing for released ones, not)."""
        if not self._windowed:
            return sum(len(t) for t in seq.block_tables)
        null = self.pool.null_block
        return sum(len(t) - t.count(null) for t in seq.block_tables)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references (its tables empty); blocks nobody references are freed or stay cached."""
        for table in seq.block_tables:
            self.pool.free(table)

    def truncate(self, seq: Sequence) -> None:
        """Roll ``seq`` back to its computed positions (speculative decoding: the drafted tokens a step
        rejected): a block left holding none of them returns to the pool."""
        for table in seq.block_tables:
            self.pool.truncate(table, seq.num_computed)

    # -- after a step -----------------------------------------------------------------------
    def cache_blocks(self, seq: Sequence) -> None:
        """Name ``seq``'s full computed blocks for the prefix cache (those named already are skipped)."""
        seed = chain_seed(seq.request.adapter_digest)
        for g, table in enumerate(seq.block_tables):
            self.pool.register_full_blocks(table, seq.token_ids, seq.num_computed, _group_seed(seed, g))

    def keep_prompt_logprobs(self, seq: Sequence, start: int) -> None:
        """Keep, beside their hashes, the prompt logprobs of the blocks of ``seq`` (a prompt) that computing
        positions ``start`` up to ``seq.num_computed`` completed; a block keeps the largest top k seen."""
        if not self.enable_prefix_caching:
            return
        req, pool, bs = seq.request, self.pool, self.block_size
        k = req.params.prompt_logprobs
        for b in range(start // bs, min(seq.num_computed, req.prompt_logprobs_upto) // bs):
            digest = pool.hashes[seq.block_table[b]] if b < len(seq.block_table) else None
            if digest in pool.cached and self._prompt_logprobs.get(digest, (-1,))[0] < k:
                self._prompt_logprobs[digest] = (k, req.prompt_logprobs[b * bs : (b + 1) * bs])

    def _prompt_logprobs_prefix(self, hashes: list[bytes], k: int) -> int:
        """How many leading ``hashes`` have prompt logprobs kept with at least the top ``k``."""
        n = 0
        while n < len(hashes) and self._prompt_logprobs.get(hashes[n], (-1,))[0] >= k:
            n += 1
        return n

    def _uncached(self, digest: bytes) -> None:
        self._prompt_logprobs.pop(digest, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody references (they become free)."""
        self.pool.reset_prefix_cache()

    # -- statistics -------------------------------------------------------------------------
    def _counts(self) -> KVCacheStats:
        p = self.pool
        return KVCacheStats(
            p.num_used,
            p.num_filled_slots,
            p.num_cached,
            p.num_cow_copies,
            p.prefix_queries,
            p.prefix_hits,
            p.blocks_reused,
            p.evictions,
            p.window_releases,
            tuple(p.used_by_group),
            tuple(p.peak_by_group),
        )

    def make_stats(self) -> KVCacheStats:
        """The pool's use now and its counts since the last `reset_stats`."""
        now = self._counts()
        for name in COUNTS:
            setattr(now, name, getattr(now, name) - getattr(self._counts_at_reset, name))
        return now

    def reset_stats(self) -> None:
        self.pool.reset_peaks()
        self._counts_at_reset = self._counts()

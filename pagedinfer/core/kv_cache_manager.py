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
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedinfer.core.block_pool import BlockPool, OutOfBlocks, block_hashes

if TYPE_CHECKING:
    from pagedinfer.core.sequence import Request, Sequence
    from pagedinfer.outputs import Logprob


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
    blocks: list[int]  # the cached blocks of the first ``len(blocks)`` hashes
    num_computed: int  # prompt positions whose K/V it saves computing

    @property
    def next_hash(self) -> bytes | None:
        """The hash of the first full prompt block not cached (None: none is left)."""
        return self.hashes[len(self.blocks)] if len(self.blocks) < len(self.hashes) else None


@dataclass
class KVCacheStats:
    """The manager's snapshot: the pool's use now, and its counts since the last `reset_stats`."""

    num_used_blocks: int = 0  # referenced by some sequence
    num_filled_slots: int = 0  # slots of those blocks holding K/V
    num_cached_blocks: int = 0  # cached, referenced by none (evictable)
    cow_copies: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the cache
    prefix_hits: int = 0  # of those, tokens whose computation the cache saved
    blocks_reused: int = 0  # blocks handed to a new sequence by a hit
    evictions: int = 0  # cached blocks reclaimed for other contents


COUNTS = ("cow_copies", "prefix_queries", "prefix_hits", "blocks_reused", "evictions")


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching, on_uncache=self._uncached)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # hash -> (k, the prompt logprobs of the block's tokens with their top k): kept while it is cached
        self._prompt_logprobs: dict[bytes, tuple[int, list]] = {}
        self._counts_at_reset = self._counts()

    # -- a new prompt -----------------------------------------------------------------------
    def prompt_hashes(self, req: Request) -> list[bytes]:
        """The chained hashes of ``req``'s full prompt blocks (made once, kept on the request)."""
        if req.prompt_hashes is None:
            seed = chain_seed(req.adapter_digest)
            req.prompt_hashes = block_hashes(req.prompt_token_ids, self.block_size, seed)
        return req.prompt_hashes

    def num_cached_blocks(self, req: Request) -> int:
        """How many of ``req``'s full prompt blocks are cached now, from the first."""
        return len(self.pool.cached_prefix(self.prompt_hashes(req)))

    def lookup(self, req: Request) -> PrefixHit:
        """``req``'s longest cached prompt prefix. With prompt logprobs still to fill, only blocks whose
        logprobs are kept count, and the last cached position is computed again: its logits give the
        first uncached token's entry. A fully cached prompt still computes its last token (its logits
        are sampled)."""
        hashes = self.prompt_hashes(req) if self.enable_prefix_caching else []
        if req.needs_prompt_logprobs:
            hashes = hashes[: self._prompt_logprobs_prefix(hashes, req.params.prompt_logprobs)]
        blocks = self.pool.cached_prefix(hashes)
        cached = len(blocks) * self.block_size
        computed = min(cached, req.num_prompt_tokens - 1)
        if req.needs_prompt_logprobs and 0 < cached < req.num_prompt_tokens:
            computed -= 1
        return PrefixHit(hashes, blocks, computed)

    def can_admit(self, req: Request, hit: PrefixHit) -> bool:
        """Whether the free blocks cover ``req``'s whole prompt started from ``hit``: the blocks still to
        allocate, the hit blocks that leave the evictable set, and the copy of the last hit block when
        it is written (`PrefixHit.num_computed` falls inside it) while another sequence holds it."""
        pool, blocks = self.pool, hit.blocks
        new = pool.blocks_for_tokens(req.num_prompt_tokens) - len(blocks)
        revived = sum(pool.ref_counts[b] == 0 for b in blocks)
        copy = hit.num_computed < len(blocks) * self.block_size and pool.ref_counts[blocks[-1]] > 0
        return new + revived + copy <= pool.num_free

    def take_prefix(self, seq: Sequence, hit: PrefixHit) -> None:
        """Start ``seq`` (a request's prompt, its table empty) from ``hit``: a reference to each hit block."""
        seq.block_table = self.pool.match_prefix(seq.token_ids, hit.hashes)

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
        """Slots for ``seq``'s next ``num_new_tokens`` positions (from ``seq.num_computed``): new blocks
        as its table needs them, and a copy of a shared partly filled block before it is written.
        None, with nothing changed, when the free blocks cannot cover them."""
        table = seq.block_table
        before = len(table)
        try:
            copies = self.pool.reserve(table, seq.num_computed, num_new_tokens)
        except OutOfBlocks:
            return None
        if not copies and len(table) == before:
            return NO_NEW_BLOCKS
        return KVCacheBlocks(tuple(table[before:]), tuple(copies))

    def fork_prompt(self, prompt: Sequence, seq: Sequence) -> int:
        """Give completion ``seq`` its blocks once its request's ``prompt`` is computed; returns how many
        of its positions they hold K/V for.

        A completion resumed after a preemption takes its own longest cached prefix when that reaches
        past the prompt's full blocks: the full blocks of its generated tokens were cached before the
        preemption and, unless evicted since, are not computed again. Any other shares the prompt's
        blocks, the partly filled last one included (reference counts rise, nothing is copied).
        """
        pool, bs = self.pool, self.block_size
        hashes = []
        if seq.num_output_tokens:
            hashes = block_hashes(seq.token_ids, bs, chain_seed(seq.request.adapter_digest))
        if len(pool.cached_prefix(hashes)) > seq.num_prompt_tokens // bs:
            seq.block_table = pool.match_prefix(seq.token_ids, hashes, prompt=False)
            return min(len(seq.block_table) * bs, len(seq.token_ids) - 1)
        seq.block_table = pool.fork(prompt.block_table)
        return prompt.num_computed

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (a beam) shares every block of ``parent``; a shared partly filled block is copied
        when one of them first writes it."""
        child.block_table = self.pool.fork(parent.block_table)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references (its table empties); blocks nobody references are freed or stay cached."""
        self.pool.free(seq.block_table)

    def truncate(self, seq: Sequence) -> None:
        """Roll ``seq`` back to its computed positions (speculative decoding: the drafted tokens a step
        rejected): a block left holding none of them returns to the pool."""
        self.pool.truncate(seq.block_table, seq.num_computed)

    # -- after a step -----------------------------------------------------------------------
    def cache_blocks(self, seq: Sequence) -> None:
        """Name ``seq``'s full computed blocks for the prefix cache (those named already are skipped)."""
        seed = chain_seed(seq.request.adapter_digest)
        self.pool.register_full_blocks(seq.block_table, seq.token_ids, seq.num_computed, seed)

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
        )

    def make_stats(self) -> KVCacheStats:
        """The pool's use now and its counts since the last `reset_stats`."""
        now = self._counts()
        for name in COUNTS:
            setattr(now, name, getattr(now, name) - getattr(self._counts_at_reset, name))
        return now

    def reset_stats(self) -> None:
        self._counts_at_reset = self._counts()

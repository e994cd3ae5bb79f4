"""The block pool alone: the seeds' worked examples, the prefix cache, and a stateful random test of both
(its hits taken through the KV-cache manager, as a run takes them; the prefix cache's worked examples
through the manager are in tests/test_kv_cache_manager.py)."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_kv_cache_manager import prompt_of, request

from pagedinfer.core.block_pool import BlockPool, OutOfBlocks, block_hashes
from pagedinfer.core.kv_cache_manager import KVCacheManager


def test_b_and_c_fit_together_in_24_slots():
    """Seed 000: B holds 6 K/V, C brings a 6-token prompt; blocks of 4 in a 6-block pool fit both."""
    pool = BlockPool(num_blocks=6, block_size=4)
    b, c = [], []
    pool.reserve(b, 0, 6)
    pool.reserve(c, 0, 6)
    assert (len(b), len(c), pool.num_used, pool.num_free) == (2, 2, 4, 2)
    pool.reserve(b, 6, 1)  # B's next input fits the free slot of its last block
    assert pool.num_filled_slots == 13 and pool.num_used * 4 - pool.num_filled_slots == 3


def test_lookup_of_position_6():
    """Seed 000: B's position 6 -> logical block 1, slot 2 -> via the table L1 -> P0."""
    pool = BlockPool(num_blocks=6, block_size=4)
    table = [3, 0]  # the seed's figure: L0 -> P3, L1 -> P0
    assert divmod(6, pool.block_size) == (1, 2)
    assert pool.slot(table, 6) == 0 * 4 + 2


def test_growth_7_8_9():
    """Seed 000: 7 -> 8 tokens needs no block; the 9th token takes one new block."""
    pool = BlockPool(num_blocks=6, block_size=4)
    b = []
    pool.reserve(b, 0, 7)
    assert len(b) == 2
    assert pool.blocks_needed(b, 7, 1) == 0
    pool.reserve(b, 7, 1)
    assert len(b) == 2
    assert pool.blocks_needed(b, 8, 1) == 1
    pool.reserve(b, 8, 1)
    assert len(b) == 3 and pool.num_used == 3


def test_two_completions_copy_on_write():
    """Seed 000: a 6-token prompt, 2 completions: 2 blocks, then 3; only the first writer copies."""
    pool = BlockPool(num_blocks=6, block_size=4)
    prompt = []
    pool.reserve(prompt, 0, 6)
    s1, s2 = pool.fork(prompt), pool.fork(prompt)
    pool.free(prompt)
    assert pool.num_used == 2 and pool.ref_counts[s1[0]] == 2 and pool.ref_counts[s1[1]] == 2
    shared_last = s1[1]
    assert pool.reserve(s1, 6, 1) == [(shared_last, s1[1])]  # a0: P1 copied to a new block
    assert s1[1] != shared_last and pool.ref_counts[shared_last] == 1
    assert pool.reserve(s2, 6, 1) == []  # b0: P1 is now s2's alone, written in place
    assert s2[1] == shared_last and s1[0] == s2[0] and pool.ref_counts[s1[0]] == 2
    assert pool.num_used == 3 and pool.num_cow_copies == 1
    pool.free(s1)
    pool.free(s2)
    assert pool.num_used == 0


def test_full_shared_block_is_never_copied():
    pool = BlockPool(num_blocks=8, block_size=4)
    prompt = []
    pool.reserve(prompt, 0, 8)  # two full blocks
    s1, s2 = pool.fork(prompt), pool.fork(prompt)
    pool.free(prompt)
    assert pool.reserve(s1, 8, 1) == [] and pool.reserve(s2, 8, 1) == []
    assert s1[:2] == s2[:2] and s1[2] != s2[2] and pool.num_used == 4


def test_out_of_blocks_changes_nothing():
    pool = BlockPool(num_blocks=2, block_size=4)
    t = []
    pool.reserve(t, 0, 8)
    with pytest.raises(OutOfBlocks):
        pool.reserve(t, 8, 1)
    assert len(t) == 2 and pool.num_free == 0


def _filled_pool(tokens: list[int], num_blocks: int = 8) -> tuple[BlockPool, list[int]]:
    """A pool where one sequence computed ``tokens`` and registered its full blocks."""
    pool = BlockPool(num_blocks=num_blocks, block_size=4)
    table: list[int] = []
    pool.reserve(table, 0, len(tokens))
    pool.register_full_blocks(table, tokens, len(tokens))
    return pool, table


def test_hashes_chain_over_the_whole_prefix():
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4), block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(a[0]) == 32  # 256-bit digests
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different parent: different hash
    assert block_hashes([1, 2, 3, 4, 5, 6, 7], 4) == a[:1]  # only full blocks are named


def test_never_cached_blocks_go_first_then_least_recently_used():
    pool, first = _filled_pool(list(range(8)), num_blocks=4)  # blocks 0, 1 cached after free
    pool.free(first)
    other: list[int] = []
    pool.reserve(other, 0, 8)  # takes the two never-cached blocks 2, 3
    assert sorted(other) == [2, 3] and pool.evictions == 0 and pool.num_cached == 2
    pool.reserve(other, 8, 1)  # the pool must evict: block 1 (the chain's tail) was freed first
    assert other[2] == 1 and pool.evictions == 1 and pool.hashes[1] is None
    assert pool.cached_prefix(block_hashes(list(range(8)), 4)) == [0]  # the head is still cached


def test_eviction_forgets_the_hash():
    pool, table = _filled_pool([5] * 4, num_blocks=1)
    pool.free(table)
    other: list[int] = []
    pool.reserve(other, 0, 3)
    assert other == [0] and pool.cached == {} and pool.cached_prefix(block_hashes([5] * 4, 4)) == []


BASES = [[7, 1, 7, 2, 7, 3, 7, 4, 7, 5, 7, 6, 7, 8, 7, 9, 7, 0, 7, 1], [2] * 20, list(range(20))]


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free over prompts that share prefixes.

    The machine keeps its own copy of every block's slots (``shadow``: what the K/V tensors would
    hold, copy-on-write copies included) and checks the pool's bookkeeping and cache against it.
    """

    CACHING = False
    BS = 4

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(12, self.BS, enable_prefix_caching=self.CACHING)  # hits as it takes them
        self.pool = self.kv.pool
        self.seqs: list[tuple[list[int], list[int]]] = []  # (table, tokens with K/V)
        self.shadow: list[list[int | None]] = [[None] * self.BS for _ in range(12)]
        self.prefix_of: dict[bytes, list[int]] = {}  # every hash seen -> the prefix it names

    def _write(self, table: list[int], tokens: list[int], start: int) -> bool:
        """Write tokens[start:] into ``table`` like a step would; False (nothing changed) when out of blocks."""
        pool, before = self.pool, list(table)
        refs, lru, free_before = list(pool.ref_counts), list(pool.evictable), len(pool.free_ids)
        evictions = pool.evictions
        try:
            copies = pool.reserve(table, start, len(tokens) - start)
        except OutOfBlocks:
            assert table == before and pool.evictions == evictions
            return False
        new = [b for b in table if b not in before]
        assert all(refs[b] == 0 for b in new)  # never handed out while referenced
        gone = [b for b in lru if b not in pool.evictable]
        assert gone == lru[: len(gone)] and pool.evictions - evictions == len(gone)  # LRU first
        assert not gone or free_before < len(new)  # never-cached blocks were taken first
        for src, dst in copies:
            assert before[start // self.BS] == src and table[start // self.BS] == dst
            self.shadow[dst] = list(self.shadow[src])
        for p in range(start, len(tokens)):
            self.shadow[table[p // self.BS]][p % self.BS] = tokens[p]
        pool.register_full_blocks(table, tokens, len(tokens))
        return True

    @rule(base=st.integers(0, 2), cut=st.integers(0, 20), suffix=st.lists(st.integers(0, 3), max_size=6))
    def allocate(self, base, cut, suffix):
        tokens = BASES[base][:cut] + suffix
        if not tokens:
            return
        reused, req = self.pool.blocks_reused, request(tokens)
        seq = prompt_of(req)
        self.kv.take_prefix(seq, self.kv.lookup(req))
        table = seq.block_table
        assert self.pool.blocks_reused - reused == len(table)
        for i, b in enumerate(table):  # a hit holds exactly the tokens asked for
            assert self.shadow[b] == tokens[i * self.BS : (i + 1) * self.BS]
        if not self._write(table, tokens, min(len(table) * self.BS, len(tokens) - 1)):
            self.pool.free(table)
            return
        self.seqs.append((table, tokens))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), new=st.lists(st.integers(0, 3), min_size=1, max_size=9))
    def append(self, i, new):
        table, tokens = self.seqs[i % len(self.seqs)]
        start = len(tokens)
        tokens += new
        if not self._write(table, tokens, start):
            del tokens[start:]

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def fork(self, i):
        table, tokens = self.seqs[i % len(self.seqs)]
        self.seqs.append((self.pool.fork(table), list(tokens)))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        table, _ = self.seqs.pop(i % len(self.seqs))
        self.pool.free(table)

    @invariant()
    def counts_match_tables(self):
        pool, bs = self.pool, self.BS
        refs = [0] * pool.num_blocks
        for table, tokens in self.seqs:
            assert len(table) == -(-len(tokens) // bs)  # on-demand: exactly the blocks the tokens need
            for p, t in enumerate(tokens):  # every position's K/V is this sequence's own token
                assert self.shadow[table[p // bs]][p % bs] == t
            for b in table:
                refs[b] += 1
        assert refs == pool.ref_counts
        free, cached = list(pool.free_ids), list(pool.evictable)
        assert len(free) + len(cached) == len(set(free) | set(cached))  # never freed twice
        assert set(free) | set(cached) == {b for b, c in enumerate(refs) if c == 0}  # free exactly at zero
        assert pool.num_filled_slots == sum(f for b, f in enumerate(pool.filled) if refs[b])
        if not self.CACHING:
            assert not cached and pool.hashes == [None] * pool.num_blocks

    @invariant()
    def hashes_match_contents(self):
        pool, bs = self.pool, self.BS
        for table, tokens in self.seqs:
            for i, digest in enumerate(block_hashes(tokens, bs)):
                if pool.hashes[table[i]] is not None:
                    assert pool.hashes[table[i]] == digest
                assert self.prefix_of.setdefault(digest, tokens[: (i + 1) * bs]) == tokens[: (i + 1) * bs]
        for digest, b in pool.cached.items():
            assert pool.hashes[b] == digest
        for b, digest in enumerate(pool.hashes):
            if digest is not None:  # a cached block's slots hold exactly the tokens its hash names
                assert pool.filled[b] == bs and self.shadow[b] == self.prefix_of[digest][-bs:]
        assert all(pool.hashes[b] is None for b in pool.free_ids)
        assert all(pool.cached[pool.hashes[b]] == b for b in pool.evictable)

    def teardown(self):
        for table, _ in self.seqs:
            self.pool.free(table)
        assert self.pool.num_free == self.pool.num_blocks and all(c == 0 for c in self.pool.ref_counts)
        assert self.pool.num_filled_slots == 0


class CachingPoolMachine(PoolMachine):
    CACHING = True


MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = MACHINE_SETTINGS
TestCachingPoolMachine = CachingPoolMachine.TestCase
TestCachingPoolMachine.settings = MACHINE_SETTINGS


def test_reset_prefix_cache_frees_cached_blocks_and_keeps_those_in_use():
    pool = BlockPool(num_blocks=6, block_size=4)
    kept, dropped = [], []
    pool.reserve(kept, 0, 4)
    pool.reserve(dropped, 0, 4)
    pool.register_full_blocks(kept, list(range(4)), 4)
    pool.register_full_blocks(dropped, list(range(10, 14)), 4)
    pool.free(dropped)
    assert pool.num_cached == 1 and len(pool.free_ids) == 4
    pool.reset_prefix_cache()
    assert (
        pool.num_cached == 0
        and len(pool.free_ids) == 5
        and pool.cached_prefix(block_hashes(list(range(10, 14)), 4)) == []
    )
    assert pool.cached_prefix(block_hashes(list(range(4)), 4)) == kept  # the block in use is still a hit

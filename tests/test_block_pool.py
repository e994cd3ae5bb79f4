"""The block pool alone: the seeds' worked examples and a stateful random test of its invariants."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedinfer.core.block_pool import BlockPool, OutOfBlocks


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


def test_two_samples_copy_on_write():
    """Seed 000: a 6-token prompt, 2 samples: 2 blocks, then 3; only the first writer copies."""
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


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / write / free; the pool's bookkeeping must always add up."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(num_blocks=12, block_size=4)
        self.seqs: list[tuple[list[int], list[int]]] = []  # (table, number of tokens with K/V)

    @rule(n=st.integers(1, 20))
    def allocate(self, n):
        table = []
        try:
            self.pool.reserve(table, 0, n)
        except OutOfBlocks:
            assert table == []
            return
        self.seqs.append((table, [n]))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), n=st.integers(1, 9))
    def append(self, i, n):
        table, length = self.seqs[i % len(self.seqs)]
        before = list(table)
        try:
            copies = self.pool.reserve(table, length[0], n)
        except OutOfBlocks:
            assert table == before
            return
        for src, dst in copies:
            assert before[length[0] // 4] == src and table[length[0] // 4] == dst
        length[0] += n

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def fork(self, i):
        table, length = self.seqs[i % len(self.seqs)]
        self.seqs.append((self.pool.fork(table), [length[0]]))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        table, _ = self.seqs.pop(i % len(self.seqs))
        self.pool.free(table)

    @invariant()
    def counts_match_tables(self):
        refs = [0] * self.pool.num_blocks
        for table, length in self.seqs:
            assert len(table) == -(-length[0] // 4)  # on-demand: exactly the blocks the tokens need
            for b in table:
                refs[b] += 1
        assert refs == self.pool.ref_counts
        free = list(self.pool.free_ids)
        assert len(free) == len(set(free))  # never freed twice
        assert set(free) == {b for b, c in enumerate(refs) if c == 0}  # free exactly at zero
        assert self.pool.num_filled_slots == sum(self.pool.filled)

    def teardown(self):
        for table, _ in self.seqs:
            self.pool.free(table)
        assert self.pool.num_free == self.pool.num_blocks and all(c == 0 for c in self.pool.ref_counts)
        assert self.pool.num_filled_slots == 0


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)

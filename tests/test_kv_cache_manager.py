"""The KV-cache manager alone, no scheduler: the seeds' worked examples as allocate / fork / free calls
with exact block counts, the prefix cache's admission, and the prompt logprobs kept beside it."""

from __future__ import annotations

from pagedinfer.core.kv_cache_manager import KVCacheManager, chain_seed
from pagedinfer.core.sequence import Request, Sequence
from pagedinfer.outputs import Logprob
from pagedinfer.sampling_params import SamplingParams


def request(prompt: list[int], rid: str = "r", **params) -> Request:
    return Request(rid, 0, None, prompt, SamplingParams(**params), 8)


def prompt_of(req: Request) -> Sequence:
    return Sequence(req, 0, True, list(req.prompt_token_ids), req.num_prompt_tokens)


def completion_of(req: Request, index: int, generated: list[int] = ()) -> Sequence:
    return Sequence(req, index, False, [*req.prompt_token_ids, *generated], req.num_prompt_tokens)


def step(kv: KVCacheManager, seq: Sequence, n: int):
    """What a step does for ``seq``: slots for its next ``n`` tokens, then those tokens computed."""
    blocks = kv.allocate(seq, n)
    assert blocks is not None
    seq.num_computed += n
    kv.cache_blocks(seq)
    return blocks


def admit(kv: KVCacheManager, req: Request) -> Sequence:
    """A waiting request's prompt started from its cached prefix, as the scheduler admits it."""
    hit = kv.lookup(req)
    assert kv.can_admit(req, hit)
    seq = prompt_of(req)
    kv.take_prefix(seq, hit)
    seq.num_computed = hit.num_computed
    return seq


def test_b_and_c_get_blocks_on_demand():
    """Seed 000: 24 slots in blocks of 4. B's 6 K/V take 2 blocks, C's 6-token prompt 2 more, 2 stay
    free; B's 7th and 8th K/V fit its last block, its 9th takes one new block."""
    kv = KVCacheManager(6, 4)
    b, c = prompt_of(request(list(range(6)), "B")), prompt_of(request(list(range(50, 56)), "C"))
    assert len(step(kv, b, 6).new_blocks) == 2 and len(step(kv, c, 6).new_blocks) == 2
    assert (kv.pool.num_used, kv.pool.num_free) == (4, 2)
    b.token_ids += [6, 7, 8]
    grown = [step(kv, b, 1) for _ in range(3)]
    assert [len(g.new_blocks) for g in grown] == [0, 0, 1] and not any(g.copies for g in grown)
    assert len(b.block_table) == 3 and kv.pool.num_used == 5
    s = kv.make_stats()
    assert (s.num_used_blocks, s.num_filled_slots) == (
        5,
        9 + 6,
    )  # each sequence's last block alone has empty slots


def test_two_completions_share_the_partial_block_and_copy_on_write():
    """Seed 000 figure 6: a 6-token prompt computed once, its 2 blocks shared by both completions
    (the partly filled P1 included); a0 copies P1 before writing, b0 then writes P1 in place: 3 blocks."""
    kv = KVCacheManager(6, 4)
    req = request(list(range(6)), n=2)
    prompt = prompt_of(req)
    step(kv, prompt, 6)
    c0, c1 = completion_of(req, 0), completion_of(req, 1)
    assert kv.fork_prompt(prompt, c0) == 6 and kv.fork_prompt(prompt, c1) == 6
    kv.free(prompt)
    p0, p1 = c0.block_table
    assert c1.block_table == [p0, p1] and [kv.pool.ref_counts[b] for b in (p0, p1)] == [2, 2]
    assert kv.pool.num_used == 2
    c0.num_computed = c1.num_computed = 6
    c0.token_ids.append(100)
    a0 = kv.allocate(c0, 1)
    assert a0.new_blocks == () and a0.copies == ((p1, c0.block_table[1]),) and c0.block_table[1] != p1
    c1.token_ids.append(200)
    b0 = kv.allocate(c1, 1)
    assert (b0.new_blocks, b0.copies) == ((), ()) and c1.block_table == [p0, p1]
    assert kv.pool.num_used == 3 and kv.pool.ref_counts[p0] == 2 and kv.pool.ref_counts[p1] == 1
    assert kv.make_stats().cow_copies == 1
    kv.free(c0)
    kv.free(c1)
    assert kv.pool.num_used == 0


def test_a_full_shared_block_stays_shared():
    kv = KVCacheManager(8, 4)
    req = request(list(range(8)), n=2)
    prompt = prompt_of(req)
    step(kv, prompt, 8)
    children = [completion_of(req, i, [90 + i]) for i in range(2)]
    for c in children:
        c.num_computed = kv.fork_prompt(prompt, c)
    kv.free(prompt)
    grants = [kv.allocate(c, 1) for c in children]
    assert [len(g.new_blocks) for g in grants] == [1, 1] and not any(g.copies for g in grants)
    assert children[0].block_table[:2] == children[1].block_table[:2] and kv.pool.num_used == 4


def test_allocate_answers_none_and_changes_nothing_when_the_pool_is_short():
    kv = KVCacheManager(2, 4)
    seq = prompt_of(request(list(range(9))))
    assert kv.allocate(seq, 9) is None
    assert seq.block_table == [] and kv.pool.num_free == 2
    step(kv, seq, 8)
    assert kv.allocate(seq, 1) is None and len(seq.block_table) == 2


def test_a_beam_fork_shares_every_block_and_the_first_writer_copies():
    kv = KVCacheManager(8, 4)
    parent = prompt_of(request(list(range(6))))
    step(kv, parent, 6)
    child = Sequence(parent.request, 1, False, list(parent.token_ids), 6, num_computed=6)
    kv.fork(parent, child)
    assert child.block_table == parent.block_table and kv.pool.num_used == 2
    assert all(kv.pool.ref_counts[b] == 2 for b in parent.block_table)
    child.token_ids.append(7)
    grant = kv.allocate(child, 1)
    assert grant.copies == ((parent.block_table[1], child.block_table[1]),) and kv.pool.num_used == 3


def test_a_shared_system_prompt_is_cached_once_and_referenced_by_each_request():
    """Seed 004 section 9: an 8-token system prompt fills one block; A computes it, B and C find it
    cached and take a reference (3 in all), each computing only its own question in its own block."""
    system = list(range(100, 108))
    kv = KVCacheManager(8, 8)
    a = admit(kv, request(system + [1, 2, 3, 4, 5, 6], "A"))
    assert a.num_computed == 0
    step(kv, a, 6 + 8)
    others = []
    for rid, question in (("B", [7, 8, 9]), ("C", [10, 11, 12, 13])):
        seq = admit(kv, request(system + question, rid))
        assert seq.num_computed == 8 and seq.block_table == a.block_table[:1]
        assert len(step(kv, seq, len(question)).new_blocks) == 1
        others.append(seq)
    shared = a.block_table[0]
    assert kv.pool.ref_counts[shared] == 3 and kv.pool.num_used == 4
    assert len({s.block_table[1] for s in (a, *others)}) == 3
    s = kv.make_stats()
    assert (s.prefix_queries, s.prefix_hits, s.blocks_reused) == (14 + 11 + 12, 16, 2)


def test_freed_full_blocks_stay_cached_and_are_hit():
    """Seed 004 section 9: a second prompt with the same 8-token preamble reuses its two blocks."""
    kv = KVCacheManager(8, 4)
    pool, first = kv.pool, prompt_of(request(list(range(10)), "A"))
    step(kv, first, 10)  # blocks: 2 full + 1 partial
    full = first.block_table[:2]
    kv.free(first)
    assert pool.num_used == 0 and pool.num_cached == 2 and pool.num_free == 8
    assert list(pool.evictable) == [full[1], full[0]]  # the tail first: evicted before the head
    hit = admit(kv, request([0, 1, 2, 3, 4, 5, 6, 7, 42], "B"))
    assert hit.block_table == full and [pool.ref_counts[b] for b in full] == [1, 1] and pool.num_cached == 0
    assert (pool.prefix_queries, pool.prefix_hits, pool.blocks_reused) == (9, 8, 2)
    assert pool.num_filled_slots == 8 and hit.num_computed == 8
    assert admit(kv, request([0, 1, 2, 3, 9, 9, 9, 9], "C")).block_table == full[:1]  # diverges in block 1
    assert pool.ref_counts[full[0]] == 2 and pool.prefix_hits == 8 + 4


def test_a_fully_cached_prompt_still_computes_its_last_token():
    """Its last token is computed for its logits; the last block is shared with the first sequence, so
    writing its last slot copies it first; the copy is a duplicate, not cached: the original serves hits."""
    tokens = list(range(8))
    kv = KVCacheManager(8, 4)
    pool, first = kv.pool, prompt_of(request(tokens, "A"))
    step(kv, first, 8)
    blocks = list(first.block_table)
    again = admit(kv, request(tokens, "B"))
    assert again.block_table == blocks and again.num_computed == 7 and pool.prefix_hits == 7
    src = blocks[1]
    assert step(kv, again, 1).copies == ((src, again.block_table[1]),) and again.block_table[1] != src
    assert pool.cached[pool.hashes[src]] == src
    kv.free(first)
    kv.free(again)  # the duplicate is not cached: it goes back to the free list
    assert pool.num_cached == 2 and pool.num_used == 0 and set(pool.evictable) == set(blocks)


def test_caching_off_frees_at_once_and_hits_nothing():
    kv = KVCacheManager(4, 4, enable_prefix_caching=False)
    pool, first = kv.pool, prompt_of(request(list(range(8)), "A"))
    step(kv, first, 8)
    assert pool.hashes == [None] * 4 and pool.cached == {}
    kv.free(first)
    assert pool.num_cached == 0 and len(pool.free_ids) == 4
    again = admit(kv, request(list(range(8)), "B"))
    assert again.block_table == [] and again.num_computed == 0 and pool.prefix_queries == 0


def test_a_fully_cached_prompt_recomputes_its_last_token_and_counts_the_copy():
    """The cached last block is still referenced by the first sequence: the admission counts its copy
    (its last slot is written again), so 2 blocks in use leave room only with a third free."""
    tokens = list(range(8))
    for num_blocks, admitted in ((2, False), (3, True)):
        kv = KVCacheManager(num_blocks, 4)
        first = prompt_of(request(tokens, "A"))
        step(kv, first, 8)
        again = request(tokens, "B")
        hit = kv.lookup(again)
        assert hit.blocks == first.block_table and hit.num_computed == 7
        assert kv.can_admit(again, hit) is admitted
    seq = admit(kv, again)
    grant = kv.allocate(seq, 1)
    assert grant.copies == ((first.block_table[1], seq.block_table[1]),) and kv.pool.num_used == 3


def test_adapters_start_their_own_chains():
    """Equal prompts under different adapters never share cached blocks (their K/V differ)."""
    kv = KVCacheManager(8, 4)
    base = request(list(range(8)), "base")
    step(kv, prompt_of(base), 8)

    class Adapter:
        digest = b"weights of a"

    tuned = request(list(range(8)), "tuned")
    tuned.lora = Adapter()
    assert kv.lookup(tuned).blocks == [] and kv.lookup(request(list(range(8)))).blocks != []
    assert chain_seed(b"") == b"" and chain_seed(b"weights of a") != chain_seed(b"weights of b")


def test_a_resumed_completion_takes_its_cached_generated_blocks_back():
    """test_scheduler's preemption case, without the scheduler: a completion computed 6 positions (3
    full blocks of 2: 4 prompt tokens, 2 generated) before it was freed; when its prompt is computed
    again, it takes its 3 cached blocks back instead of the prompt's 2: 6 positions are computed."""
    kv = KVCacheManager(8, 2)
    req = request([50, 51, 52, 53])
    prompt = prompt_of(req)
    step(kv, prompt, 4)
    done = completion_of(req, 0, [7, 8, 9])
    done.num_computed = kv.fork_prompt(prompt, done)
    kv.free(prompt)
    step(kv, done, 2)  # positions 4, 5: the third block is full and cached
    kv.free(done)  # preempted
    done.num_computed = 0
    prompt = admit(kv, req)
    assert prompt.num_computed == 3  # the prompt is cached: its last token is computed again
    step(kv, prompt, 1)
    assert kv.fork_prompt(prompt, done) == 6 and len(done.block_table) == 3
    fresh = completion_of(req, 1)  # nothing generated yet: it shares the prompt's blocks
    assert kv.fork_prompt(prompt, fresh) == 4 and fresh.block_table == prompt.block_table


def test_prompt_logprobs_are_kept_beside_cached_blocks_and_dropped_with_them():
    """A request that needs prompt logprobs hits only blocks whose entries were kept; once its blocks
    leave the cache, the entries go too, and the same blocks cached again without them do not count."""
    tokens = list(range(10, 19))  # 2 full blocks of 4 and 1 token

    def entries(req: Request) -> None:
        req.prompt_logprobs = [None] + [{t: Logprob(-1.0, 1)} for t in req.prompt_token_ids[1:]]
        req.prompt_logprobs_upto = req.num_prompt_tokens

    kv = KVCacheManager(4, 4)
    first = request(tokens, "A", prompt_logprobs=1)
    seq = admit(kv, first)
    step(kv, seq, 9)
    entries(first)
    kv.keep_prompt_logprobs(seq, 0)
    kv.free(seq)
    second = request(tokens, "B", prompt_logprobs=1)
    hit = kv.lookup(second)
    # both full blocks hit; the last cached position (7) is computed again for token 8's entry
    assert len(hit.blocks) == 2 and hit.num_computed == 7
    got = kv.cached_prompt_logprobs(second, hit)
    assert len(got) == 8 and got[0] is None and got[1:] == first.prompt_logprobs[1:8]
    assert kv.lookup(request(tokens, "C", prompt_logprobs=2)).blocks == []  # kept with top 1 only
    kv.reset_prefix_cache()
    again = admit(kv, request(tokens, "D"))  # recomputed and cached without prompt logprobs
    step(kv, again, 9)
    kv.free(again)
    assert len(kv.lookup(request(tokens, "E")).blocks) == 2
    assert kv.lookup(request(tokens, "F", prompt_logprobs=1)).blocks == []


def test_stats_count_since_the_last_reset():
    kv = KVCacheManager(4, 4)
    seq = prompt_of(request(list(range(8))))
    step(kv, seq, 8)
    kv.free(seq)
    admit(kv, request(list(range(8))))
    before = kv.make_stats()
    assert (before.prefix_queries, before.prefix_hits, before.blocks_reused) == (8, 7, 2)
    kv.reset_stats()
    after = kv.make_stats()
    assert (after.prefix_queries, after.prefix_hits, after.blocks_reused, after.cow_copies) == (0, 0, 0, 0)
    assert after.num_used_blocks == 2 and after.num_cached_blocks == 0

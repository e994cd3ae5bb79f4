"""Prefix caching through the engine: same greedy tokens with and without it, and exact token accounting."""

import random

import pytest
from conftest import ENGINE

from pagedinfer import LLM, SamplingParams

BS = 4


def shared_prefix_prompts(prefix_len: int, count: int, seed: int = 0) -> tuple[list[int], list[dict]]:
    """W3 in miniature: one shared preamble, then each request's own question of 1-9 tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(2, 256) for _ in range(prefix_len)]
    prompts = [
        {"prompt_token_ids": prefix + [rng.randrange(2, 256) for _ in range(rng.randrange(1, 10))]}
        for _ in range(count)
    ]
    return prefix, prompts


def run(path, prompts, params, caching=True, **engine):
    llm = LLM(
        str(path), block_size=BS, enable_prefix_caching=caching, **{"num_blocks": 400, **engine}, **ENGINE
    )
    out = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.pool.num_used == 0  # every reference returned (cached blocks are unreferenced)
    return [[c.token_ids for c in o.outputs] for o in out], llm


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_tokens_equal_without_cache_also_when_evicting_and_preempting(tiny_model, family):
    path = tiny_model(family)
    _, prompts = shared_prefix_prompts(23, 10)
    prompts += [{"prompt_token_ids": prompts[0]["prompt_token_ids"][:20]}] * 2  # fully cached: 5 blocks
    params = SamplingParams(n=2, temperature=0, max_tokens=10)
    want, _ = run(path, prompts, params, caching=False)
    got, llm = run(path, prompts, params)
    assert got == want and llm.stats.prefix_cache_hits > 0 and llm.stats.preemptions == 0
    small, llm = run(path, prompts, params, num_blocks=24)  # the pool holds ~2 requests at a time
    s = llm.stats
    assert small == want
    assert s.preemptions > 0 and s.prefix_cache_evictions > 0 and s.prompt_tokens_readmitted > 0
    assert s.prefix_cache_blocks_reused > 0
    chunked, _ = run(path, prompts, params, max_num_batched_tokens=7)  # prompts prefilled in chunks
    assert chunked == want


def test_prompt_tokens_computed_w3_shape(tiny_model):
    """The shared prefix's full blocks are computed once, each request's remainder once, and a fully
    cached prompt recomputes its last token only (for its logits)."""
    prefix, prompts = shared_prefix_prompts(4 * BS + 3, 16, seed=1)  # 4 full shared blocks + 3 tokens
    full = prompts[3]["prompt_token_ids"][: 5 * BS]  # 5 full blocks, the 5th written by request 3
    prompts += [{"prompt_token_ids": full}, {"prompt_token_ids": prefix[: 4 * BS]}]
    _, llm = run(tiny_model("llama"), prompts, SamplingParams(n=3, temperature=0, max_tokens=4))
    s = llm.stats
    shared = 4 * BS
    lengths = [len(p["prompt_token_ids"]) for p in prompts]
    own = sum(n - shared for n in lengths[:16])
    # + the last token of each fully cached prompt (``full`` hits request 3's 5th block too)
    assert s.prompt_tokens_computed == shared + own + 2
    assert s.prompt_tokens_requested == 3 * sum(lengths)
    assert s.prompt_tokens_saved_by_sharing == 2 * sum(lengths)
    assert s.prefix_cache_queries == sum(lengths)
    assert s.prefix_cache_hits == sum(lengths) - s.prompt_tokens_computed
    assert s.prompt_tokens_computed == (
        s.prompt_tokens_requested - s.prompt_tokens_saved_by_sharing - s.prefix_cache_hits
    )
    assert s.prefix_cache_blocks_reused == 15 * 4 + 5 + 4
    assert s.prefix_cache_evictions == 0


def test_cache_outlives_the_generate_call_and_is_off_when_asked(tiny_model):
    _, prompts = shared_prefix_prompts(2 * BS + 1, 3, seed=2)
    params = SamplingParams(temperature=0, max_tokens=5)
    llm = LLM(str(tiny_model("llama")), block_size=BS, num_blocks=100, **ENGINE)
    first = llm.generate(prompts, params, use_tqdm=False)
    second = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    lengths = [len(p["prompt_token_ids"]) for p in prompts]
    # the second call finds every full block cached, prompt and generated tokens alike
    assert llm.stats.prompt_tokens_computed == sum(n - n // BS * BS or 1 for n in lengths)
    off = LLM(str(tiny_model("llama")), block_size=BS, num_blocks=100, enable_prefix_caching=False, **ENGINE)
    off.generate(prompts, params, use_tqdm=False)
    off.generate(prompts, params, use_tqdm=False)
    d = off.stats.to_dict()
    assert d["prefix_cache"]["enabled"] is False and d["prefix_cache"]["queries"] == 0
    assert off.stats.prompt_tokens_computed == sum(lengths) and off.engine.pool.num_cached == 0


def test_lpm_admission_keeps_interleaved_families_cached_under_a_small_pool(tiny_model):
    """Four prompt families arriving round-robin, a pool that keeps about one family's prefix: first
    come first served evicts each prefix before its family's next request; lpm admits the requests
    whose prefix is cached first. Same greedy tokens, fewer prompt tokens computed."""
    families = [shared_prefix_prompts(6 * BS, 6, seed=10 + f)[1] for f in range(4)]
    prompts = [families[f][i] for i in range(6) for f in range(4)]
    params = SamplingParams(temperature=0, max_tokens=3)
    tokens, stats = {}, {}
    for policy in ("fcfs", "lpm"):
        tokens[policy], llm = run(
            tiny_model("llama"), prompts, params, num_blocks=24, max_num_seqs=2, schedule_policy=policy
        )
        stats[policy] = llm.stats
    fcfs, lpm = stats["fcfs"], stats["lpm"]
    assert tokens["lpm"] == tokens["fcfs"]
    assert lpm.schedule_policy == "lpm" and fcfs.schedule_policy == "fcfs"
    assert lpm.prefix_cache_hit_rate > fcfs.prefix_cache_hit_rate + 0.2
    assert lpm.prompt_tokens_computed < fcfs.prompt_tokens_computed
    assert lpm.prefix_cache_evictions < fcfs.prefix_cache_evictions


def test_a_resumed_completion_continues_from_its_cached_generated_blocks(tiny_model):
    """test_scheduler's preemption case through the model: the second request is preempted after
    generating 2 tokens into a full block; on its return it takes that block from the cache instead
    of recomputing it, and its greedy tokens are those of a run without preemption."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [50, 51, 52, 53]}]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 8)]
    path = tiny_model("llama")
    got = {}
    for caching, blocks in ((True, 7), (False, 7), (False, 100)):
        llm = LLM(str(path), block_size=2, num_blocks=blocks, enable_prefix_caching=caching, **ENGINE)
        got[caching, blocks] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        s = llm.stats
        assert s.preemptions == (blocks == 7)
        if blocks == 7:
            assert (s.output_tokens_restored, s.output_tokens_recomputed) == ((2, 0) if caching else (0, 2))
    assert got[True, 7] == got[False, 7] == got[False, 100]

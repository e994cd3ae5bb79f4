"""Windowed and global layers in the pool: each layer group's own block tables, a windowed group giving
its blocks back once they leave the window, exact per-group counts, and outputs unchanged.

The models: a tiny gemma3_text (a window of 16 on layers 0-2, layer 3 global: four groups of one
layer, on our own layers), a tiny mistral (a window of 8 on both layers: one windowed group),
a tiny Qwen2 with its window on layer 1 (a global and a windowed group on our own layers) and a tiny
gpt_oss (a window of 8 on layer 0, layer 1 global, attention sinks on both: our own layers).
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from conftest import ENGINE
from models import count_one_call_steps, hf_greedy, refused_then_run
from rich.console import Console
from test_beam_search import hf_beams
from test_beam_search import prompts as beam_prompts
from test_kv_cache_manager import admit, completion_of, request, step
from test_speculative import oracle_drafts

from pagedinfer import LLM, BeamSearchParams, SamplingParams
from pagedinfer.attention import cuda_kernels, cuda_on_cpu
from pagedinfer.cli.report import render, report_dict
from pagedinfer.core.kv_cache_manager import KVCacheManager
from pagedinfer.core.speculative import RowCost
from pagedinfer.model import decode_step
from pagedinfer.ray.stats import merge

MAX_TOKENS = 16
_REFERENCE: dict[tuple, list[int]] = {}  # transformers' tokens by (model, prompt): both pools compare


def reference(path, prompt: list[int]) -> list[int]:
    key = (str(path), tuple(prompt))
    if key not in _REFERENCE:
        _REFERENCE[key] = hf_greedy(path, prompt, MAX_TOKENS)
    return _REFERENCE[key]


def blocks(n: int, bs: int) -> int:
    return -(-n // bs)


def window_need(start: int, tokens: int, window: int, bs: int) -> int:
    """Blocks a windowed table holds while a step computes positions [start, start + tokens): those from
    the block of the first position the step's first query reads, to the block of its last position."""
    return blocks(start + tokens, bs) - max(0, start - window + 1) // bs


def schedule(prompt: int, max_tokens: int, budget: int) -> list[tuple[int, int]]:
    """One sequence's steps alone in the engine: (start, tokens) of each prompt chunk, then each decode."""
    steps = [(s, min(budget, prompt - s)) for s in range(0, prompt, budget)]
    return steps + [(s, 1) for s in range(prompt, prompt + max_tokens - 1)]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    out = [[rng.randrange(2, 256) for _ in range(n)] for n in (5, 17, 40, 70)]
    # short prompts decoding side by side: a windowed pool preempts when their windows outgrow it
    short = [[rng.randrange(2, 256) for _ in range(n)] for n in (3, 4, 6, 7, 9, 10, 11, 12)]
    return [*short, *out, out[3][:60] + out[0]]  # a 60-token prefix of the 70: prefix-cache hits


@pytest.mark.parametrize("family", ["gemma3_text", "mistral", "qwen2_window", "gpt_oss"])
@pytest.mark.parametrize(
    ("num_blocks", "budget"), [(256, 512), (24, 16)], ids=["roomy-pool", "preempting-pool"]
)
def test_greedy_matches_transformers(tiny_model, prompts, family, num_blocks, budget, monkeypatch):
    """Our own layers (gemma3_text, mistral, the windowed Qwen2) decode in the one-call C step, which
    reads each layer's group's tables."""
    path = tiny_model(family)
    steps = count_one_call_steps(monkeypatch)
    llm = LLM(str(path), block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget, **ENGINE)
    groups = llm.engine.kv.groups
    assert [g.window for g in groups] == {
        "gemma3_text": [0, 16, 16, 16],
        "mistral": [8],
        "qwen2_window": [0, 8],
        "gpt_oss": [0, 8],
    }[family]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference(path, prompt), f"prompt of {len(prompt)}"
    stats = llm.stats
    assert llm.engine.pool.num_used == 0 and stats.kv.window_releases > 0
    assert (stats.preemptions > 0) == (num_blocks == 24)
    assert stats.prefix_cache_hits > 0
    assert bool(steps) == (family in ("gemma3_text", "mistral", "qwen2_window"))


def test_the_one_call_step_checks_each_groups_table(tiny_model, monkeypatch):
    """The windowed Qwen2's C step, given a windowed-group table naming a block past the pool, refuses
    before any layer (the pool untouched); as given, it runs."""
    steps = count_one_call_steps(monkeypatch)
    run = decode_step.DecodeStep.run
    refusals: list[str] = []

    def probed(self, residual, ropes, meta):
        windowed = meta.group_metas[1]
        tables = windowed.block_tables.clone()
        tables[-1, (int(windowed.context_lens[-1]) - 1) // self.kv.block_size] = self.kv.num_blocks
        bad = dataclasses.replace(
            meta, group_metas=[meta, dataclasses.replace(windowed, block_tables=tables)]
        )
        return refused_then_run(run, self, residual, ropes, meta, [bad], refusals)

    def generate() -> tuple[list[int], int]:
        llm = LLM(str(tiny_model("qwen2_window")), block_size=4, num_blocks=32, **ENGINE)
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        assert out.error is None, out.error
        return out.outputs[0].token_ids, llm.engine.kv.num_blocks

    plain, num_blocks = generate()
    monkeypatch.setattr(decode_step.DecodeStep, "run", probed)
    assert generate() == (plain, num_blocks) and steps  # the step ran on the tables as given
    pool = f"block {num_blocks}, outside the KV pool's {num_blocks} blocks"
    # every step: the 3-token prompt's (a chunk the C step takes) and both decode steps
    assert refusals == [f"decode step: sequence 0's block table names {pool}"] * 3


def test_cuda_kernels_read_each_groups_tables(tiny_model):
    """The CUDA kernels (run on the CPU) on a windowed Qwen2 of head size 64: n=2 completions forking
    the prompt's blocks in both groups, greedy-identical to transformers with and without preemption."""
    path = tiny_model("qwen2_window_d64")
    prompts = [list(range(3, 3 + n)) for n in (5, 12, 30)]
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    cuda_kernels.set_raw_module_factory(cuda_on_cpu.RawModule)
    try:
        for num_blocks in (64, 12):
            llm = LLM(str(path), block_size=8, num_blocks=num_blocks, device="cpu", use_cuda_kernels=True)
            assert llm.engine.runner.use_cuda_kernels and [g.window for g in llm.engine.kv.groups] == [0, 8]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            for prompt, out in zip(prompts, outs, strict=True):
                assert [c.token_ids for c in out.outputs] == [reference(path, prompt)] * 2
            stats = llm.stats
            assert (stats.preemptions > 0) == (num_blocks == 12) and stats.kv.window_releases > 0
            assert stats.cow_copies > 0 and llm.engine.pool.num_used == 0
    finally:
        cuda_kernels.set_raw_module_factory(None)


def test_block_counts_per_group(tiny_model):
    """One request alone, its prompt in chunks of 8: each step's blocks per group are exactly what the
    step's positions and the window need (blocks of 4, window 16)."""
    llm = LLM(str(tiny_model("gemma3_text")), block_size=4, num_blocks=64, max_num_batched_tokens=8, **ENGINE)
    prompt, n = list(range(2, 39)), 20
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
    expected = [(blocks(s + q, 4), *[window_need(s, q, 16, 4)] * 3) for s, q in schedule(len(prompt), n, 8)]
    assert llm.stats.group_blocks_used == expected
    assert expected[-1] == (14, 4, 4, 4)  # 56 positions: 14 blocks kept globally, 4 in each window
    assert llm.stats.blocks_used == [sum(e) for e in expected]


def test_w7_long_prompt_peak_within_the_windows_need(tiny_model):
    """W7: a 300-token prompt and 60 generated tokens, window 16, blocks of 16, prompts computed 32
    tokens a step: the peak is what the windows need (within 1.2x), and the report says so."""
    bs, window, prompt_len, n = 16, 16, 300, 60
    llm = LLM(
        str(tiny_model("gemma3_text")), block_size=bs, num_blocks=32, max_num_batched_tokens=32, **ENGINE
    )
    prompt = [random.Random(7).randrange(2, 256) for _ in range(prompt_len)]
    out = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == n
    need = max(blocks(s + q, bs) + 3 * window_need(s, q, window, bs) for s, q in schedule(prompt_len, n, 32))
    kept = 4 * blocks(prompt_len + n - 1, bs)  # every layer keeping every block: 4 x 23
    stats = llm.stats
    assert (need, kept) == (29, 92)
    assert stats.peak_blocks_used <= 1.2 * need
    doc = report_dict(stats, {})["layer_groups"]
    assert [(g["window"], g["layers"]) for g in doc["groups"]] == [(0, [3]), (16, [0]), (16, [1]), (16, [2])]
    assert sum(g["peak_blocks_used"] for g in doc["groups"]) >= stats.peak_blocks_used
    assert doc["groups"][0]["peak_blocks_used"] == blocks(prompt_len + n - 1, bs)
    assert doc["blocks_without_windows_at_peak"] == 4 * stats.group_blocks_used[stats.peak_step][0]
    console = Console(record=True, width=200)
    render(stats, console)
    text = console.export_text()
    assert "Layer groups" in text and "window 16" in text and "fewer than keeping every block" in text


def test_replicas_merge_per_group(tiny_model):
    """Data-parallel replicas of a windowed model (`ray.stats.merge`): each group's blocks added step by
    step (a replica past its last step adds nothing), the windows' releases summed, the report's group
    peaks those of the merged series."""
    runs = []
    for n, max_tokens in ((90, 20), (40, 10)):  # replicas that run different numbers of steps
        llm = LLM(str(tiny_model("gemma3_text")), block_size=4, num_blocks=64, **ENGINE)
        prompt = {"prompt_token_ids": [random.Random(n).randrange(2, 256) for _ in range(n)]}
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        runs.append(llm.stats)
    merged = merge(runs, 1.0)
    a, b = (r.group_blocks_used for r in runs)
    assert len(a) > len(b) and merged.layer_groups == runs[0].layer_groups
    assert merged.group_blocks_used == [
        tuple(x + y for x, y in zip(a[i], b[i] if i < len(b) else (0,) * 4, strict=True))
        for i in range(len(a))
    ]
    assert merged.blocks_used == [sum(g) for g in merged.group_blocks_used]
    assert merged.kv.window_releases == sum(r.kv.window_releases for r in runs) > 0
    doc = report_dict(merged, {})["layer_groups"]
    assert [g["peak_blocks_used"] for g in doc["groups"]] == [
        max(c) for c in zip(*merged.group_blocks_used, strict=True)
    ]


def test_forks_release_shared_prompt_blocks_after_all_passed():
    """Two completions share a 12-token prompt (blocks of 4, window 4 in group 1): a shared block leaves
    the pool only once both completions have passed it."""
    kv = KVCacheManager(32, 4, windows=(0, 4))
    req = request(list(range(12)), n=2)
    prompt = admit(kv, req)
    step(kv, prompt, 12)
    a, b = completion_of(req, 0, [100]), completion_of(req, 1, [200])
    for c in (a, b):
        kv.fork_prompt(prompt, c)
        c.num_computed = 12
    kv.free(prompt)
    shared = list(a.block_tables[1])
    assert b.block_tables[1] == shared and len(shared) == 3
    for t in range(101, 106):  # a computes positions 12-16 alone: its last step's window starts at 13
        step(kv, a, 1)
        a.token_ids.append(t)
    assert a.block_tables[1][:3] == [kv.pool.null_block] * 3
    assert [kv.pool.ref_counts[x] for x in shared] == [1, 1, 1]  # b still holds them
    step(kv, b, 1)  # b at position 12: its window starts at 9, so blocks 0 and 1 go
    assert b.block_tables[1][:2] == [kv.pool.null_block] * 2
    assert [kv.pool.ref_counts[x] for x in shared] == [0, 0, 1]
    assert kv.pool.window_releases == 5
    # global: the 3 shared blocks, a's blocks 3 and 4, b's block 3; windowed: shared block 2 (b's),
    # a's blocks 3 and 4, b's block 3
    assert kv.pool.used_by_group == [6, 4]


def test_prefix_hit_needs_only_the_window_blocks():
    """A second request with the same 20-token prompt (blocks of 4, window 6 in group 1): the hit covers
    all 5 full blocks in the global group, its last token computed again (position 19); the windowed
    group takes the blocks that position's window reads (14 and up: blocks 3 and 4), the null block
    standing before them."""
    kv = KVCacheManager(32, 4, windows=(0, 6))
    first = admit(kv, request(list(range(20))))
    step(kv, first, 20)
    kv.free(first)
    hit = kv.lookup(request(list(range(20)), "again"))
    null = kv.pool.null_block
    assert hit.num_computed == 19 and len(hit.tables[0]) == 5 and null not in hit.tables[0]
    assert hit.tables[1][:3] == [null] * 3 and null not in hit.tables[1][3:] and len(hit.tables[1]) == 5
    again = admit(kv, request(list(range(20)), "again"))
    assert again.block_tables == hit.tables and again.num_computed == 19
    assert kv.pool.blocks_reused == 7  # 5 global, 2 windowed


def test_records_do_not_depend_on_batch_or_pool(tiny_model, prompts):
    """Seeded sampling with logprobs on a windowed Qwen2 (a global and a windowed group on our own
    layers: the reproducibility contract's path), n=2: every record the same one request at a time in
    a roomy pool and sixteen sequences at a time in a pool that preempts, with prefix-cache hits in
    both."""
    path = str(tiny_model("qwen2_window"))
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_TOKENS, logprobs=2, n=2)
    records = []
    for seqs, num_blocks in ((2, 256), (16, 32)):
        llm = LLM(
            path, block_size=4, num_blocks=num_blocks, max_num_seqs=seqs, max_num_batched_tokens=16, **ENGINE
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        records.append([[(c.token_ids, c.logprobs, c.cumulative_logprob) for c in o.outputs] for o in outs])
        assert (llm.stats.preemptions > 0) == (num_blocks == 32) and llm.stats.prefix_cache_hits > 0
    assert records[0] == records[1]


@pytest.mark.parametrize("family", ["gemma3_text", "qwen2_window"])
def test_beams_on_windowed_layers_equal_transformers(tiny_model, family):
    """Beam search (width 4, 20 tokens) forks, prunes and frees tables in every group; in a pool that
    preempts, the beams are transformers' and every block is back in the pool."""
    path = tiny_model(family)
    params = BeamSearchParams(4, 20, early_stopping=True)
    batch = beam_prompts(11, 3)
    llm = LLM(str(path), block_size=4, num_blocks=30, **ENGINE)
    out = llm.beam_search([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for prompt, got in zip(batch, out, strict=True):
        assert [s.token_ids for s in got.sequences] == [w[0] for w in hf_beams(path, prompt, params)]
    stats = llm.stats
    assert stats.preemptions > 0 and stats.kv.window_releases > 0 and llm.engine.pool.num_used == 0


@pytest.mark.parametrize("family", ["mistral", "qwen2_window"])
def test_speculative_rollback_keeps_windowed_tables_exact(tiny_model, monkeypatch, family):
    """Drafted tokens on the windowed mistral (blocks of 4, window 8: one group) and Qwen2 (a global
    and a windowed group), drawn from the run without them with every third draft's last token wrong:
    rejected ones are cut back table by table, the tokens are the same, every block is back in the
    pool."""
    path = str(tiny_model(family))
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 5}, {"prompt_token_ids": [9, 10] * 9}]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    off = LLM(path, block_size=4, num_blocks=64, **ENGINE)
    outputs = off.generate(prompts, params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in outputs]
    oracle_drafts(monkeypatch, outputs)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    on = LLM(path, block_size=4, num_blocks=64, speculative_config=spec, **ENGINE)
    on.engine.set_row_cost(RowCost(math.inf))  # draft wherever a match exists
    assert [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)] == want
    sources = on.engine.stats.speculation.sources.values()
    assert sum(c.drafted for c in sources) > sum(c.accepted for c in sources) > 0
    assert on.engine.pool.num_used == 0 and on.stats.kv.window_releases > 0

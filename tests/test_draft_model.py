"""Speculative decoding from a draft model (``speculative_config`` method ``draft_model``): records are
byte-identical with it on and off (greedy, seeded sampling, n > 1, a pool small enough to preempt),
a draft equal to the target has every greedy draft accepted, and a draft whose vocabulary is not the
target's is refused naming both models. Its K/V live in the target's blocks: the pool's budget holds
both models' layers (fewer blocks, admission counting them), a run takes no block more than without
the draft, a preemption frees the draft's K/V with the target's, a request's completions share their
prompt's draft K/V, a rejected draft's are cut with the target's, and every block is back at the end.

Drafts are taken wherever the draft model has one (`RowCost(math.inf)`, as in test_speculative.py), so
the tests do not depend on this machine's timing."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import transformers as tf
from test_speculative import PROMPTS, TEXT, engine_view, records

from pagedinfer import LLM, SamplingParams
from pagedinfer.config import EngineConfig, SpeculativeConfig
from pagedinfer.core.block_pool import BlockPool
from pagedinfer.core.scheduler import Scheduler
from pagedinfer.core.speculative import RowCost, Speculator, StepTimes
from pagedinfer.engine.draft_model import DraftModel
from pagedinfer.model.loader import ModelLoadError
from pagedinfer.model.random_models import save_random_model


def draft_spec(model: Path, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def draft_model(text_model, tmp_path_factory) -> Path:
    """A one-layer random decoder with ``text_model``'s tokenizer (its own weights: few drafts match)."""
    path = tmp_path_factory.mktemp("draft") / "draft-llama"
    shutil.copytree(text_model, path)
    config = tf.AutoConfig.from_pretrained(path)
    config.num_hidden_layers = 1
    save_random_model(config, path, seed=7)
    return path


@pytest.fixture(scope="module")
def text_llm(text_model) -> LLM:
    return LLM(str(text_model), device="cpu", num_blocks=128)


def same_on_and_off(base: LLM, spec: dict, prompts, params, **engine) -> LLM:
    """Assert the records match with the draft model off and on; return the speculating `LLM`."""
    off = records(engine_view(base, None, **engine), prompts, params)
    on_llm = engine_view(base, spec, **engine)
    on = records(on_llm, prompts, params)
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        assert a == b, f"line {i} differs with the draft model on"
    return on_llm


def draft_counts(llm: LLM) -> dict:
    return llm.engine.stats.to_dict()["speculation"]["sources"]["draft_model"]


def assert_pools_empty(llm: LLM) -> None:
    """Every block of the pool, which holds the draft's K/V too, is back once the run is over."""
    pool = llm.engine.pool
    assert pool.num_used == 0 and pool.num_free == pool.num_blocks


def test_draft_equal_to_the_target_has_every_greedy_draft_accepted(text_llm, text_model):
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True, n=2),
    ]
    llm = same_on_and_off(text_llm, draft_spec(text_model), PROMPTS[:2], params)
    counts = draft_counts(llm)
    assert counts["drafted"] > 0 and counts["accepted"] == counts["drafted"]
    # every step but a sequence's first takes 1 + 4 tokens, or what is left of max_tokens
    assert llm.engine.stats.tokens_per_seq_step > 3.0
    assert_pools_empty(llm)


def test_small_draft_model_greedy_seeded_and_n(text_llm, draft_model):
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, logprobs=3, prompt_logprobs=2),
        SamplingParams(max_tokens=30, temperature=0.7, seed=5, n=3, logprobs=2),
        SamplingParams(max_tokens=30, temperature=1.0, top_k=20, top_p=0.9, seed=9, n=2),
    ]
    llm = same_on_and_off(text_llm, draft_spec(draft_model), PROMPTS, params)
    stats = llm.engine.stats.to_dict()["speculation"]
    counts = stats["sources"]["draft_model"]
    assert counts["drafted"] > 0 and 0 <= counts["accepted"] < counts["drafted"]
    assert stats["mode"] == f"on: draft_model {draft_model}, up to 4 drafted tokens"
    share, target = stats["draft_pool"], llm.engine.kv.bytes_per_block
    assert 2 * share["bytes_per_block"] == target  # one layer of the target's two
    assert share["kv_bytes"] == 128 * share["bytes_per_block"] and share["computed_positions"] > 0
    pool = llm.engine.stats.to_dict()["pool"]
    assert pool["bytes_per_block"] == target + share["bytes_per_block"]
    assert pool["kv_bytes_total"] == 128 * (target + share["bytes_per_block"])
    assert_pools_empty(llm)


def test_draft_model_under_preemption(text_llm, text_model, monkeypatch):
    """A pool of 12 blocks preempts; a preempted request's blocks, the draft's K/V in them, are free
    at once: the pool's use falls by exactly the blocks it alone held, some holding the draft's K/V."""
    drafted_freed = []
    preempt = Scheduler._preempt

    def counting(self, req):
        pool = self.kv_cache_manager.pool
        refs = Counter(b for s in [req.prompt_seq, *req.completions] if s for t in s.block_tables for b in t)
        alone = [b for b, n in refs.items() if pool.ref_counts[b] == n]
        used, drafted = pool.num_used, any(pool.draft_filled[b] for b in alone)
        preempt(self, req)
        assert pool.num_used == used - len(alone)
        drafted_freed.append(drafted)

    monkeypatch.setattr(Scheduler, "_preempt", counting)
    params = [SamplingParams(max_tokens=40, seed=i, temperature=0.5 * (i % 2), n=2) for i in range(4)]
    prompts = [PROMPTS[i % 3] for i in range(4)]
    llm = same_on_and_off(text_llm, draft_spec(text_model), prompts, params, num_blocks=12)
    assert llm.engine.stats.preemptions > 0
    assert draft_counts(llm)["accepted"] > 0
    assert llm.engine.pool.num_blocks == 12 and any(drafted_freed)
    assert_pools_empty(llm)


def test_a_draft_model_run_takes_no_block_more(text_llm, text_model):
    """The draft's K/V sit in the target's blocks: a greedy line of 16 prompt tokens and 20 output
    tokens, blocks of 4, peaks at the 9 blocks of its 35 computed positions with the draft on (every
    draft accepted) as off, and the draft's K/V take none of their own."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(10, 26))}]
    for spec in (None, draft_spec(text_model)):
        llm = engine_view(text_llm, spec, block_size=4, num_blocks=32)
        llm.generate(prompt, params, use_tqdm=False)
        assert llm.engine.stats.to_dict()["usage"]["peak_blocks_used"] == 9
        assert_pools_empty(llm)
    assert draft_counts(llm)["accepted"] == draft_counts(llm)["drafted"] > 0


def test_the_budget_holds_both_models_and_admission_counts_them(text_llm, text_model):
    """``kv_cache_memory`` is the budget of both models' K/V: a draft as large as the target halves
    the blocks it buys (6 to 3). Two prompts of 8 tokens (2 blocks each) then run one after the other,
    the second refused by admission until the first is done (3 blocks cannot hold both prompts), where
    without the draft both run at once; a prompt of 16 tokens, which may need 5 blocks, is refused."""
    per_block = engine_view(text_llm, None, block_size=4, num_blocks=8).engine.kv.bytes_per_block
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(10 + i, 18 + i))} for i in range(2)]
    peaks = []
    for spec, blocks in ((None, 6), (draft_spec(text_model), 3)):
        llm = engine_view(text_llm, spec, block_size=4, kv_cache_memory=6 * per_block, num_blocks=None)
        assert llm.engine.pool.num_blocks == blocks
        assert llm.engine.stats.to_dict()["pool"]["kv_bytes_total"] == 6 * per_block
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
        peaks.append(llm.engine.stats.peak_running_seqs)
    assert peaks == [2, 1]
    (long,) = llm.generate([{"prompt_token_ids": list(range(10, 26))}], params, use_tqdm=False)
    assert "may need 5 KV blocks" in long.error and "the pool has 3" in long.error


def test_completions_share_their_prompts_draft_kv(text_llm, text_model):
    """n = 2 greedy completions of a 16-token prompt (4 full blocks of 4): the first's first draft
    computes the prompt's draft K/V into the shared blocks, the second's reads them in the same pass,
    so the draft computes 16 positions fewer than two separate lines would (n = 1 twice)."""
    prompt = [{"prompt_token_ids": list(range(10, 26))}]
    computed = {}
    for n in (1, 2):
        llm = engine_view(text_llm, draft_spec(text_model), block_size=4, num_blocks=32)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=n)
        llm.generate(prompt, params, use_tqdm=False)
        computed[n] = llm.engine.stats.to_dict()["speculation"]["draft_pool"]["computed_positions"]
        assert draft_counts(llm)["accepted"] == draft_counts(llm)["drafted"] > 0
        assert_pools_empty(llm)
    assert computed[2] == 2 * computed[1] - 16


class Seq:
    """What the draft model reads of a sequence: its tokens (the pending one last) and block tables."""

    def __init__(self, token_ids: list[int], table: list[int] | None = None) -> None:
        self.token_ids = token_ids
        self.block_tables = [table if table is not None else []]


def drafting(pool: BlockPool, tokens: list[int], k: int) -> Seq:
    """A sequence with the slots the target's step gives a draft of ``k``: its pending token and the
    drafted ones."""
    seq = Seq(tokens)
    pool.reserve(seq.block_tables[0], 0, len(tokens) + k)
    return seq


def test_a_rejected_drafts_kv_is_cut_with_the_targets(text_llm):
    """The draft's K/V of a sequence cover its pending token and the drafted tokens but the last; the
    target's rollback cuts them to the verified positions, and the next draft computes only the
    pending token, drafting what a fresh pool drafts for the same tokens."""
    loaded = text_llm.engine.loaded
    prompts = [text_llm.get_tokenizer().encode(p) for p in PROMPTS[:2]]
    fresh_pool = BlockPool(64, 4)
    fresh = DraftModel(loaded, fresh_pool, 64, loaded.dtype)
    both = fresh.propose([(drafting(fresh_pool, p, 4), 4) for p in prompts])  # batched
    pool = BlockPool(64, 4)
    drafter = DraftModel(loaded, pool, 64, loaded.dtype)
    seq = drafting(pool, prompts[0], 4)
    assert drafter.gap(seq) == len(prompts[0])
    assert drafter.propose([(seq, 4)]) == [both[0]]
    assert pool.draft_computed(seq.block_tables[0]) == len(prompts[0]) + 3  # the last drafted not computed
    seq.token_ids = prompts[0] + both[0][:1] + [both[0][1] ^ 1]  # one accepted, then a mismatch
    pool.truncate(seq.block_tables[0], len(prompts[0]) + 1)  # the target's rollback
    assert pool.draft_computed(seq.block_tables[0]) == len(prompts[0]) + 1
    assert drafter.gap(seq) == 1
    pool.reserve(seq.block_tables[0], len(seq.token_ids) - 1, 1 + 2)
    again = fresh.propose([(drafting(fresh_pool, seq.token_ids, 2), 2)])
    assert drafter.propose([(seq, 2)]) == again
    assert drafter.make_stats().computed_positions == len(prompts[0]) + 3 + 2


def test_the_pool_keeps_the_drafts_slots_with_its_blocks():
    """A block's draft slots: held as written, cut by truncation, none in a block taken anew (a
    copy-on-write copy or a freed block), kept by a cached block for the request that hits it."""
    pool = BlockPool(8, 4)
    table = []
    pool.reserve(table, 0, 10)
    pool.hold_draft(table, 0, 9)
    assert [pool.draft_filled[b] for b in table] == [4, 4, 1] and pool.draft_computed(table) == 9
    pool.truncate(table, 6)
    assert pool.draft_computed(table) == 6 and len(table) == 2
    child = pool.fork(table)
    copies = pool.reserve(child, 6, 1)  # the shared partly filled block is copied: its draft slots not
    assert len(copies) == 1 and pool.draft_computed(child) == 4 and pool.draft_computed(table) == 6
    pool.register_full_blocks(table, list(range(6)), 6)
    first = table[0]
    pool.free(table)
    pool.free(child)
    assert pool.cached_prefix([pool.hashes[first]]) == [first]
    pool.acquire([first])  # a later request with the same first block
    assert pool.draft_computed([first]) == 4
    pool.free([first])
    fresh = []
    pool.reserve(fresh, 0, 4 * pool.num_blocks)  # every block taken anew, the cached one evicted
    assert pool.draft_computed(fresh) == 0


def test_a_draft_of_another_vocabulary_is_refused(text_llm, tiny_model):
    other = tiny_model("llama")  # 256 token ids, no tokenizer; the text model has its own
    with pytest.raises(ModelLoadError) as e:
        engine_view(text_llm, draft_spec(other))
    assert str(e.value) == (
        f"speculative_config.model: the draft model {str(other)!r} does not share the vocabulary of the "
        f"target model {text_llm.engine.loaded.name!r} (256 token ids against the target's "
        f"{text_llm.vocab_size:,}); a draft model needs the target's tokenizer"
    )


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"method": "draft_model", "num_speculative_tokens": 2}, "method draft_model needs model"),
        ({"method": "ngram", "model": "m", "num_speculative_tokens": 2}, "model is for method draft_model"),
        ({"model": 3, "num_speculative_tokens": 2}, "model must be a model path or id, not 3"),
    ],
)
def test_bad_draft_model_config_is_named(value, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(speculative_config=value)


def test_model_key_alone_means_draft_model():
    config = EngineConfig(speculative_config={"model": "m", "num_speculative_tokens": 2})
    assert (config.speculative_config.method, config.speculative_config.model) == ("draft_model", "m")


def test_command_line_option(tmp_path, tiny_model):
    from cli_helpers import invoke, one_line_error, speculation_on_and_off
    from cli_helpers import tiny_model as cli_model

    target = cli_model()
    common, report = speculation_on_and_off(tmp_path, target, draft_spec(target, 3), TEXT)
    assert report["mode"] == f"on: draft_model {target}, up to 3 drafted tokens"
    # the gate prices the draft's passes (here as dear as the target's steps): whether it drafts is
    # this machine's timing; the records are the same either way, and the draft's share is reported
    assert "draft_model" in report["sources"] and report["draft_pool"]["bytes_per_block"] > 0
    bad = invoke(
        *common,
        "-o",
        tmp_path / "bad.jsonl",
        "--speculative-config",
        json.dumps(draft_spec(tiny_model("llama"))),
    )
    one_line_error(bad, "does not share the vocabulary of the target model")


def test_a_draft_model_that_does_not_load_is_named(text_llm, tmp_path):
    with pytest.raises(ModelLoadError, match=r"^speculative_config\.model: the draft model '.*missing': "):
        engine_view(text_llm, draft_spec(tmp_path / "missing"))


def test_a_windowed_draft_model(tiny_model):
    """A draft with a global and a windowed layer group (Qwen2, window 8, blocks of 4) for itself: its
    K/V follow the target's global group's tables (its windowed layers mask, release nothing), the
    target's windowed group gives back the blocks its window has left, every greedy draft is
    accepted, and every block is back at the end."""
    path = tiny_model("qwen2_window")
    base = LLM(str(path), device="cpu", block_size=4, num_blocks=64)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 5}, {"prompt_token_ids": [9, 10] * 9}]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = same_on_and_off(base, draft_spec(path), prompts, params)
    counts = draft_counts(llm)
    assert counts["drafted"] > 0 and counts["accepted"] == counts["drafted"]
    assert llm.engine.scheduler.kv_cache_manager.make_stats().window_releases > 0
    assert_pools_empty(llm)


class FixedGap:
    """A draft model whose lines each lack ``gap`` positions (what the gate reads of one)."""

    def __init__(self, gap: int) -> None:
        self.times, self.gap_rows = StepTimes(), gap

    def gap(self, seq) -> int:
        return self.gap_rows


class Request:
    """What the gate reads of a request: its max_tokens (hashed by identity, as the engine's)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens


def gate(draft_scale: float, gap: int = 1, left: int = 100, seqs: int = 1) -> int:
    """The tokens the gate grants a line's first draft-model draft (0: refused) in a step of ``seqs``
    sequences, a target step of R rows costing 9 + R and a draft pass of R rows ``draft_scale`` times
    that; the line lacks ``gap`` positions of draft K/V and has ``left`` tokens to go."""
    spec = SpeculativeConfig.parse(draft_spec(Path("m")))
    speculator = Speculator(spec, RowCost(9.0), FixedGap(gap), RowCost(9.0, scale=draft_scale))
    seq = Seq([1, 2, 3])
    seq.logits_state, seq.request, seq.num_output_tokens = None, Request(left), 0
    draft = speculator.propose(seq, 4, seqs)
    return 0 if draft is None else len(draft.token_ids)


def test_the_gate_prices_the_draft_models_passes():
    """At a draft model's first rate (9/10), a draft of 4 at batch 1 gives 4.1 tokens for 14 target
    rows' time plus 4 draft passes: with passes at a tenth of a target step (1 each) 4.1 in 18 beats
    1 in 10; with passes as dear as the target's (10 each) no length pays. At batch 8 the same cheap
    passes close the gate (at most 8.9 tokens in 19 against 8 in 17, under the margin) where free
    ones would open it (11.1 in 21)."""
    assert gate(0.1) == 4
    assert gate(1.0) == 0
    assert gate(0.1, seqs=8) == 0
    assert gate(0.0, seqs=8) == 4
    # a line 300 positions behind catches up in the first pass (30 more in the draft model): worth it
    # for a line with 400 tokens to go (its share about a hundredth), not for one with 4
    assert gate(0.1, gap=300, left=400) == 4
    assert gate(0.1, gap=300, left=4) == 0


def test_the_gate_closes_where_the_draft_model_cannot_pay(text_llm, text_model):
    """A draft equal to the target, priced (fixed costs, not this machine's times): at a tenth of the
    target's cost its drafts are made and every one accepted; as dear as the target, none is made and
    it computes nothing. Records are those of the run without speculation either way."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    off = records(engine_view(text_llm, None, max_num_seqs=1), PROMPTS, params)
    for scale, drafts in ((0.1, True), (1.0, False)):
        llm = engine_view(text_llm, draft_spec(text_model), max_num_seqs=1)
        llm.engine.set_row_cost(RowCost(9.0), RowCost(9.0, scale=scale))
        assert records(llm, PROMPTS, params) == off
        counts, stats = draft_counts(llm), llm.engine.stats.to_dict()["speculation"]
        if drafts:
            assert counts["drafted"] > 0 and counts["accepted"] == counts["drafted"]
        else:
            assert counts["drafted"] == 0 and stats["gated_seq_steps"] > 0
            assert stats["draft_pool"]["computed_positions"] == 0
        assert_pools_empty(llm)


def test_a_target_windowed_in_every_layer_runs_without_the_draft_model(tiny_model):
    """Mistral (window 8 on every layer, blocks of 4): its only layer group releases blocks a lagging
    draft line would need, so the draft model is not loaded and speculation is off, said once."""
    from pagedinfer.engine.llm_engine import SpeculationOff

    path = tiny_model("mistral")
    with pytest.warns(SpeculationOff, match="a draft model needs a target whose first layer group"):
        llm = LLM(str(path), device="cpu", block_size=4, num_blocks=64, speculative_config=draft_spec(path))
    assert llm.engine.drafter is None and llm.engine.scheduler.speculator is None
    assert llm.engine.speculation_mode.endswith("(its layers attend through a window of 8 tokens)")


def test_a_draft_model_outside_the_contract_is_let_go(tiny_model):
    """GPT-2 on transformers' layers (outside the reproducibility contract): speculation is off, the
    draft model and its tensors are let go, and the report's blocks hold the target's layers alone."""
    from pagedinfer.engine.llm_engine import SpeculationOff

    path = tiny_model("gpt2")
    with pytest.warns(SpeculationOff, match="transformers' gpt2 layers"):
        llm = LLM(str(path), device="cpu", num_blocks=16, speculative_config=draft_spec(path))
    assert llm.engine.drafter is None and llm.engine.scheduler.speculator is None
    assert llm.engine.stats.to_dict()["pool"]["bytes_per_block"] == llm.engine.kv.bytes_per_block

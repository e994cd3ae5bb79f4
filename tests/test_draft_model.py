"""Speculative decoding from a draft model (``speculative_config`` method ``draft_model``): records are
byte-identical with it on and off (greedy, seeded sampling, n > 1, a pool small enough to preempt),
a draft equal to the target has every greedy draft accepted, every block of both pools is back at the
end, and a draft whose vocabulary is not the target's is refused naming both models.

Drafts are taken wherever the draft model has one (`RowCost(math.inf)`, as in test_speculative.py), so
the tests do not depend on this machine's timing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers as tf
from test_speculative import PROMPTS, TEXT, engine_view, records

from pagedinfer import LLM, SamplingParams
from pagedinfer.config import EngineConfig, SpeculativeConfig
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
    """Every block of the target's pool and of the draft's is back once the run is over."""
    assert llm.engine.pool.num_used == 0
    drafter = llm.engine.drafter
    assert (
        drafter.manager.pool.num_used == 0
        and drafter.manager.pool.num_free == drafter.manager.pool.num_blocks
    )


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
    pool = stats["draft_pool"]
    assert pool["num_blocks"] == 128 and pool["used_blocks"] == 0 and pool["peak_blocks"] > 0
    assert_pools_empty(llm)


def test_draft_model_under_preemption(text_llm, text_model, monkeypatch):
    """A pool of 12 blocks preempts; the draft's pool has as many blocks, too few for every line that
    drafts in a step: some drafts are cut short (and padded, their rows being planned already)."""
    cut_short = []
    propose = DraftModel.propose

    def counting(self, wants):
        made = propose(self, wants)
        cut_short.extend(len(tokens) < k for tokens, (_, k) in zip(made, wants, strict=True))
        return made

    monkeypatch.setattr(DraftModel, "propose", counting)
    params = [SamplingParams(max_tokens=40, seed=i, temperature=0.5 * (i % 2), n=2) for i in range(4)]
    prompts = [PROMPTS[i % 3] for i in range(4)]
    llm = same_on_and_off(text_llm, draft_spec(text_model), prompts, params, num_blocks=12)
    assert llm.engine.stats.preemptions > 0
    assert draft_counts(llm)["accepted"] > 0
    assert llm.engine.drafter.manager.pool.num_blocks == 12
    assert any(cut_short)
    assert_pools_empty(llm)


class Seq:
    """What the draft model reads of a sequence: its tokens (the pending one last)."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids


def test_draft_lines_roll_back_and_make_room(text_llm):
    """A line keeps the K/V of the tokens the sequence still has (a rejected draft's are given back),
    and a full pool drops the least recently drafted line, which drafts the same tokens afterwards."""
    loaded = text_llm.engine.loaded
    prompts = [text_llm.get_tokenizer().encode(p) for p in PROMPTS[:2]]
    fresh = DraftModel(loaded, 64, 4, loaded.dtype).propose([(Seq(p), 4) for p in prompts])  # batched
    small = DraftModel(loaded, blocks_for(prompts[0], 4) + 1, 4, loaded.dtype)  # one line at a time
    pool, first = small.manager.pool, Seq(prompts[0])
    assert small.propose([(first, 4)]) == [fresh[0]]
    assert pool.num_used == blocks_for(prompts[0], 3)  # the last drafted token is not computed
    first.token_ids = prompts[0] + fresh[0][:1] + [fresh[0][1] ^ 1]  # one accepted, then a mismatch
    small.propose([(first, 1)])  # keeps the prompt and the accepted token's K/V, gives back the rest
    assert pool.num_used == blocks_for(first.token_ids, 0)
    assert small.propose([(Seq(prompts[1]), 4)]) == [fresh[1]]
    assert first not in small._lines  # dropped to make room
    assert small.propose([(Seq(prompts[0]), 4)]) == [fresh[0]]
    for seq in list(small._lines):
        small.forget(seq)
    assert pool.num_used == 0


def blocks_for(tokens: list[int], extra: int) -> int:
    return -(-(len(tokens) + extra) // 4)


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
    # this machine's timing; the records are the same either way, and the pool is reported
    assert "draft_model" in report["sources"] and report["draft_pool"]["used_blocks"] == 0
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
    pool gives back the blocks its window has left, every greedy draft is accepted, and every block is
    back at the end."""
    path = tiny_model("qwen2_window")
    base = LLM(str(path), device="cpu", block_size=4, num_blocks=64)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 5}, {"prompt_token_ids": [9, 10] * 9}]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = same_on_and_off(base, draft_spec(path), prompts, params)
    counts = draft_counts(llm)
    assert counts["drafted"] > 0 and counts["accepted"] == counts["drafted"]
    assert llm.engine.drafter.manager.make_stats().window_releases > 0
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
    that; the line lacks ``gap`` positions in the draft's pool and has ``left`` tokens to go."""
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
    its pool computes nothing. Records are those of the run without speculation either way."""
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
            assert stats["draft_pool"]["peak_blocks"] == 0
        assert_pools_empty(llm)

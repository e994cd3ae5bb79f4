"""Speculative decoding changes no bit: every line's record (token ids, text, logprobs and
prompt_logprobs as exact floats, finish and stop reasons) is the same with speculation on and off, for
greedy and seeded sampling, n > 1, stop strings, max_tokens ending inside a draft, logit controls,
structured outputs, a LoRA line, int8, bfloat16 and every GGUF weight type, beam search and a pool
small enough to preempt. Each speculating run asserts that drafts were accepted, so the verified path
ran; the sources with a test of their own (lines finished earlier, a grammar's forced tokens) assert
that their drafts were.

Drafts are taken wherever a match exists (`RowCost(math.inf)`: rows cost nothing) so that the tests do
not depend on this machine's timing; the gate is tested on its own. Random tiny models rarely repeat
themselves, so the matrix tests draft from an oracle (`oracle_drafts`: the run without speculation's
own tokens, every few drafts with its last token wrong), which exercises acceptance, rejection and
rollback at every offset whatever the model; the n-gram sources run on the demo model, which does
repeat itself, and the text model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from models import save_lora

from pagedinfer import LLM, LoRARequest, SamplingParams
from pagedinfer.config import EngineConfig, SpeculativeConfig
from pagedinfer.core.block_pool import BlockPool
from pagedinfer.core.speculative import (
    EXPLORE_EVERY,
    Acceptance,
    Draft,
    FinishedLines,
    NgramIndex,
    RequestLines,
    RowCost,
    Speculator,
    StepTimes,
    could_pay,
    draft_length,
    expected_tokens,
)
from pagedinfer.engine.llm_engine import LLMEngine, SpeculationOff
from pagedinfer.sampling_params import BeamSearchParams, StructuredOutputsParams

REPO = Path(__file__).resolve().parent.parent
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}

_spec = importlib.util.spec_from_file_location("make_golden", REPO / "scripts" / "make_golden.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)

TEXT = "the quick brown fox jumps over the lazy dog. " * 3
PROMPTS = [TEXT, "hello world, hello world, hello", TEXT + "the quick"]


def engine_view(base: LLM, spec: dict | None, **engine) -> LLM:
    """An `LLM` over ``base``'s loaded model with other engine settings (nothing loaded again); with
    ``spec``, drafts are taken wherever a match exists."""
    view = LLM.__new__(LLM)
    first = base.engine
    view.engine = LLMEngine(
        first.loaded, dataclasses.replace(first.config, speculative_config=spec, **engine)
    )
    if spec is not None:
        view.engine.set_row_cost(RowCost(math.inf))
    return view


def records(llm: LLM, prompts, params, **kw) -> list[str]:
    return [golden.record(o) for o in llm.generate(prompts, params, use_tqdm=False, **kw)]


def accepted(llm: LLM, source: str | None = None) -> int:
    """Drafted tokens accepted (from ``source`` alone, when given)."""
    sources = llm.engine.stats.speculation.sources
    return sum(c.accepted for name, c in sources.items() if source in (None, name))


def oracle_drafts(monkeypatch, outputs) -> None:
    """Draft each completion's next tokens from ``outputs`` (the run without speculation, by request
    order and completion index); every third draft's last token is wrong (a rejection inside it)."""
    tokens = {(i, c.index): list(c.token_ids) for i, o in enumerate(outputs) for c in o.outputs}

    def lookup(self, seq, room):
        done = seq.num_output_tokens  # the pending token included
        draft = tokens.get((seq.request.order, seq.index), [])[done : done + room]
        if not draft:
            return None
        if done % 3 == 0:
            draft[-1] ^= 1
        return Draft("prompt_lookup", draft)

    monkeypatch.setattr(Speculator, "_lookup", lookup)


def same_on_and_off(base: LLM, prompts, params, monkeypatch=None, **kw) -> LLM:
    """Assert the records match with speculation off and on (with ``monkeypatch``, drafts from the
    oracle); return the speculating `LLM` (to read its counts)."""
    engine = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in dataclasses.fields(EngineConfig)}}
    outputs = engine_view(base, None, **engine).generate(prompts, params, use_tqdm=False, **kw)
    off = [golden.record(o) for o in outputs]
    if monkeypatch is not None:
        oracle_drafts(monkeypatch, outputs)
    on_llm = engine_view(base, SPEC, **engine)
    on = records(on_llm, prompts, params, **kw)
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        assert a == b, f"line {i} differs with speculation on"
    return on_llm


@pytest.fixture(scope="module")
def text_llm(text_model) -> LLM:
    return LLM(str(text_model), device="cpu", num_blocks=128)


def test_greedy_and_seeded_sampling_with_logprobs_are_unchanged(text_llm):
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=3, prompt_logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.7, seed=5, n=3, logprobs=2),
        SamplingParams(max_tokens=40, temperature=1.0, top_k=20, top_p=0.9, seed=9, n=2),
    ]
    llm = same_on_and_off(text_llm, PROMPTS, params)
    stats = llm.engine.stats
    assert accepted(llm) > 0
    assert stats.tokens_per_seq_step > 1.0
    assert stats.to_dict()["speculation"]["sources"]["prompt_lookup"]["accepted"] > 0


def test_demo_model_drafts_from_its_own_text():
    """The n-gram sources themselves on a model that repeats itself (the package's demo model)."""
    base = LLM(None, device="cpu", num_blocks=64)
    prompts = ["To be or not to be, that is the question. To be or not", "The king, the king, the king"]
    params = [
        SamplingParams(max_tokens=60),
        SamplingParams(max_tokens=60, temperature=0.8, seed=3, n=2, logprobs=2),
    ]
    llm = same_on_and_off(base, prompts, params)
    assert accepted(llm) > 0


def test_stop_strings_and_max_tokens_inside_a_draft(text_llm, monkeypatch):
    off = engine_view(text_llm, None).generate(PROMPTS[:1], SamplingParams(max_tokens=40), use_tqdm=False)
    text = off[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # met mid-output: a draft may run past it
    params = [
        SamplingParams(max_tokens=40, stop=[stop]),
        SamplingParams(max_tokens=40, stop=[stop], include_stop_str_in_output=True, seed=1, temperature=0.5),
        *[SamplingParams(max_tokens=m) for m in (1, 2, 3, 7, 13)],  # ends at every offset of a draft
    ]
    llm = same_on_and_off(text_llm, [PROMPTS[0]] * len(params), params, monkeypatch)
    assert accepted(llm) > 0


def test_logit_controls_are_unchanged(text_llm, monkeypatch):
    tok = text_llm.get_tokenizer()
    banned = tok.encode(" fox")
    params = [
        SamplingParams(max_tokens=30, logit_bias={banned[0]: -5.0}, seed=2, temperature=0.8),
        SamplingParams(max_tokens=30, bad_words=[" lazy"]),
        SamplingParams(max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1),
        SamplingParams(max_tokens=30, min_tokens=20, seed=3, temperature=0.6),
    ]
    llm = same_on_and_off(text_llm, [PROMPTS[0]] * len(params), params, monkeypatch)
    assert accepted(llm) > 0


def test_structured_outputs_are_unchanged(text_llm, monkeypatch):
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    so = StructuredOutputsParams(json=schema)
    params = [
        SamplingParams(max_tokens=40, structured_outputs=so),
        SamplingParams(max_tokens=40, structured_outputs=so, seed=4, temperature=0.9, n=2),
        SamplingParams(max_tokens=40),  # a free line beside them drafts
    ]
    llm = same_on_and_off(text_llm, [PROMPTS[0]] * len(params), params, monkeypatch)
    assert accepted(llm) > 0


def test_preemption_in_a_tiny_pool(text_llm, monkeypatch):
    params = [SamplingParams(max_tokens=40, seed=i, temperature=0.5, n=2) for i in range(4)]
    llm = same_on_and_off(text_llm, [PROMPTS[i % 3] for i in range(4)], params, monkeypatch, num_blocks=12)
    assert llm.engine.stats.preemptions > 0
    assert accepted(llm) > 0


def test_beam_search_runs_without_speculation(text_llm):
    params = BeamSearchParams(beam_width=3, max_tokens=12)
    got = [
        [(s.token_ids, s.cumulative_logprob, s.finish_reason) for s in o.sequences]
        for llm in (engine_view(text_llm, None), engine_view(text_llm, SPEC))
        for o in llm.beam_search([{"prompt": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    ]
    assert got[:2] == got[2:]


def test_lora_lines_beside_drafting_lines(text_model, tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("spec-lora")
    adapter = LoRARequest("a", 1, str(save_lora(text_model, root, "a", 4, seed=1)))
    base = LLM(str(text_model), device="cpu", num_blocks=128, enable_lora=True)
    params = [SamplingParams(max_tokens=30, seed=i, temperature=0.4) for i in range(3)]
    kw = {"lora_request": [adapter, None, None]}
    off_llm = engine_view(base, None)  # each engine attaches its adapter sites to the shared model:
    off_llm.engine.add_lora(adapter)  # the next one is made once this one is done
    outputs = off_llm.generate(PROMPTS, params, use_tqdm=False, **kw)
    oracle_drafts(monkeypatch, outputs)
    on_llm = engine_view(base, SPEC)
    on_llm.engine.add_lora(adapter)
    assert records(on_llm, PROMPTS, params, **kw) == [golden.record(o) for o in outputs]
    assert accepted(on_llm) > 0


def test_int8_weights(tiny_model, monkeypatch):
    base = LLM(str(tiny_model("llama")), device="cpu", num_blocks=64, quantization="int8")
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}, {"prompt_token_ids": [9, 10] * 6}]
    params = [SamplingParams(max_tokens=40), SamplingParams(max_tokens=40, seed=3, temperature=0.6, n=2)]
    llm = same_on_and_off(base, prompts, params, monkeypatch)
    assert accepted(llm) > 0


def test_no_block_holds_unverified_tokens_after_a_step(text_llm, monkeypatch):
    params = [SamplingParams(max_tokens=40, n=2, seed=i) for i in range(len(PROMPTS))]
    oracle_drafts(monkeypatch, engine_view(text_llm, None).generate(PROMPTS, params, use_tqdm=False))
    llm = engine_view(text_llm, SPEC, block_size=4)
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(engine.intake.prepare(p, params[i], str(i)), i)
    pool, bs = engine.pool, 4
    while engine.has_unfinished:
        engine.step()
        for req in engine.scheduler.running:
            for seq in req.live_seqs():
                # the table covers the verified positions exactly; no block past them is hashed
                assert len(seq.block_table) == pool.blocks_for_tokens(seq.num_computed)
                assert all(pool.hashes[b] is None for b in seq.block_table[seq.num_computed // bs :])
    assert pool.num_used == 0
    assert accepted(llm) > 0


def test_truncate_returns_emptied_blocks():
    pool = BlockPool(8, 4)
    table: list[int] = []
    pool.reserve(table, 0, 10)  # 3 blocks, the last holding 2
    pool.truncate(table, 5)
    assert len(table) == 2 and pool.num_free == 6
    assert pool.filled[table[1]] == 1 and pool.num_filled_slots == 5


def test_ngram_index_finds_the_latest_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2]
    index = NgramIndex(1, 3)
    index.extend(tokens)
    assert index.at[(1, 2)] == 6  # followed by 3 at position 6, the latest occurrence
    assert index.at[(2, 3)] == 7
    assert (1, 2, 3, 8) not in index.at


@dataclasses.dataclass(eq=False)
class Line:
    """A completion as `RequestLines` sees it: its tokens (prompt, then output)."""

    token_ids: list[int]
    num_prompt_tokens: int


def test_request_lines_answer_as_a_scan_of_the_siblings_does():
    """The request's index answers every lookup as the scan it replaces (each completion's latest
    output occurrence of the n-gram; for siblings the first other completion in completions order
    holding it), while completions grow and are cut back, over random tokens of a small vocabulary
    (so n-grams repeat within and across completions)."""
    rng = random.Random(5)
    lo, hi = 1, 3
    prompt = [rng.randrange(4) for _ in range(6)]
    lines = [Line(list(prompt), len(prompt)) for _ in range(5)]
    index = RequestLines(SimpleNamespace(prompt_token_ids=prompt), lo, hi)

    def latest(line: Line) -> dict[tuple[int, ...], int]:
        """Each n-gram of ``line`` followed by an output token -> that token's latest position."""
        t, at = line.token_ids, {}
        for p in range(max(line.num_prompt_tokens, 1), len(t)):
            for n in range(lo, min(hi, p) + 1):
                at[tuple(t[p - n : p])] = p
        return at

    cuts = 0
    for _ in range(300):
        line = rng.choice(lines)
        if rng.random() < 0.15 and len(line.token_ids) > line.num_prompt_tokens:
            del line.token_ids[rng.randrange(line.num_prompt_tokens, len(line.token_ids)) :]
            cuts += 1
        else:
            line.token_ids += [rng.randrange(4) for _ in range(rng.randint(1, 3))]
        index.sync(lines)
        scans = [latest(line) for line in lines]
        grams = set().union(*scans) | {(9,), (0, 9)}  # and n-grams no line holds
        for i, seq in enumerate(lines):
            assert index.lines[index.slots[seq]].at == scans[i]
            for gram in grams:
                first = next(
                    (
                        (s, at[gram])
                        for s, at in zip(lines, scans, strict=True)
                        if s is not seq and gram in at
                    ),
                    None,
                )
                assert index.sibling(seq, gram) == first
    assert cuts > 20
    alone = Line(list(prompt), len(prompt))  # n = 1: no siblings, its own n-grams all the same
    index = RequestLines(SimpleNamespace(prompt_token_ids=prompt), lo, hi)
    for tokens in ([1, 2, 3, 1, 2], [1], [3, 1, 2, 0]):
        alone.token_ids[len(prompt) :] = tokens
        index.sync([alone])
        assert index.lines[0].at == latest(alone) and index.sibling(alone, (1, 2)) is None


def test_the_gate_drafts_only_where_rows_pay():
    acceptance = Acceptance()
    assert acceptance.rate == 0.5
    for _ in range(5):
        acceptance.record(0, True)
    assert acceptance.rate < 0.1
    assert draft_length(0.1, 4, 8, RowCost(math.inf).seconds) == 4  # rows free: all of it
    assert draft_length(0.99, 4, 1, RowCost(0.0).seconds) == 0  # rows as dear as the step: never
    # a step of 9 fixed + 1 a row: 1 token in 10, 1.5 in 11 with a row at 1/2, 1.75 in 12 with two;
    # the third's 1/8 does not pay for itself
    assert draft_length(0.5, 4, 1, RowCost(9.0).seconds) == 2
    assert draft_length(0.9, 4, 8, RowCost(9.0).seconds) == 4  # 11.1 in 21 beats 8 in 17 by 12%
    assert draft_length(0.8, 4, 8, RowCost(9.0).seconds) == 0  # 10.4 in 21: by 5%, under the margin
    # a jump from 1 row to 2 (the one-row decode path) then cheap rows: a draft pays only when long
    jump = {1: 10.0, 2: 20.0, 3: 20.5, 4: 21.0, 5: 21.5}.__getitem__
    assert draft_length(0.9, 4, 1, jump) == 4 and draft_length(0.9, 1, 1, jump) == 0
    # eight sequences' drafts granted one after another (as the scheduler does), each judged against
    # the step as the drafts before it grew it: rows cheap up to 13, then each row dearer than a
    # token is worth: the first draft is taken whole, the second in part, the rest refused (judged
    # each against the bare step, every one would take 4: 8 rows + 32 drafted)
    steep = lambda r: 10.0 + r if r <= 13 else 23.0 + 3 * (r - 13)  # noqa: E731
    assert draft_length(0.9, 4, 8, steep) == 4
    rows, tokens, taken = 8, 8.0, []
    for _ in range(8):
        taken.append(draft_length(0.9, 4, 8, steep, rows, tokens))
        rows, tokens = rows + taken[-1], tokens + expected_tokens(0.9, taken[-1])
    assert taken == [4, 1, 0, 0, 0, 0, 0, 0]
    # with every row as cheap as the first (9 fixed + 1 a row), each still pays: the last ones less
    rows, tokens, taken = 8, 8.0, []
    for _ in range(8):
        taken.append(draft_length(0.9, 4, 8, RowCost(9.0).seconds, rows, tokens))
        rows, tokens = rows + taken[-1], tokens + expected_tokens(0.9, taken[-1])
    assert taken == [4, 4, 4, 4, 4, 4, 3, 3]


def test_speculator_proposes_from_prompt_and_siblings(text_llm, monkeypatch):
    spec = SpeculativeConfig.parse(SPEC)
    engine = engine_view(text_llm, None).engine
    req = engine.add_request(engine.intake.prepare(PROMPTS[0], SamplingParams(max_tokens=5, n=2), "x"), 0)
    engine.step()  # the prompt; each completion holds its first token
    s0, s1 = req.completions
    speculator = Speculator(spec, RowCost(math.inf))
    prompt = req.prompt_token_ids
    assert s0.token_ids[-1] not in prompt  # so only the 1-gram below matches
    s0.token_ids.append(prompt[3])
    draft = speculator.propose(s0, 4, 1)
    assert draft is not None and draft.source == "prompt_lookup"
    at = max(i for i, t in enumerate(prompt) if t == prompt[3]) + 1
    assert draft.token_ids == prompt[at : at + 4]  # what followed its latest earlier occurrence
    assert Speculator(spec, RowCost(0.0)).propose(s0, 4, 1) is None  # the gate refuses
    s1.token_ids += [40000, 40001, 40002]  # a sibling's output holding a suffix nothing else has
    s0.token_ids += [40000]
    speculator.fill([])  # the step is over: lookups see the tokens appended since (synced once a step)
    draft = speculator.propose(s0, 4, 1)
    assert draft is not None and draft.source == "siblings" and draft.token_ids == [40001, 40002]
    engine.abort_all()


@pytest.mark.parametrize(
    "value, words",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "is above"),
        ({"num_speculative_tokens": 2, "draft": 1}, "unknown key 'draft'"),
        (
            {"num_speculative_tokens": 2, "suffix_decoding_max_cached_requests": -1},
            "suffix_decoding_max_cached_requests must be an integer >= 0, not -1",
        ),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_speculative_config_is_named(value, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(speculative_config=value)


def test_prompt_lookup_defaults_follow_vllm():
    assert SpeculativeConfig.parse({"num_speculative_tokens": 3}).prompt_lookup_min == 5
    c = SpeculativeConfig.parse({"num_speculative_tokens": 3, "prompt_lookup_max": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)


def test_speculation_is_off_outside_the_contract(tiny_model):
    with pytest.warns(SpeculationOff, match="transformers' gpt2 layers"):
        llm = LLM(str(tiny_model("gpt2")), device="cpu", num_blocks=16, speculative_config=SPEC)
    assert llm.engine.scheduler.speculator is None
    assert llm.engine.stats.to_dict()["speculation"]["mode"].startswith("off: transformers' gpt2")


def test_command_line_option(tmp_path):
    from cli_helpers import invoke, one_line_error, speculation_on_and_off, tiny_model

    common, report = speculation_on_and_off(tmp_path, tiny_model(), SPEC, TEXT)
    assert report["mode"] == "on: ngram, up to 4 drafted tokens" and "prompt_lookup" in report["sources"]
    bad = invoke(
        *common, "-o", tmp_path / "bad.jsonl", "--speculative-config", '{"num_speculative_tokens": 0}'
    )
    one_line_error(bad, "--speculative-config.num_speculative_tokens must be an integer >= 1, not 0")


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_lines_draft_from_lines_finished_earlier(text_llm):
    """One request at a time (two sequences at most), each twice: the second copies what the first wrote (its draft from
    the finished lines), greedy and seeded n > 1 with logprobs."""
    params = [
        SamplingParams(max_tokens=30, logprobs=2),
        SamplingParams(max_tokens=30, temperature=0.8, seed=7, n=2, logprobs=1),
    ]
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    llm = same_on_and_off(text_llm, prompts, params * 2, max_num_seqs=2)
    assert accepted(llm, "finished") > 0
    assert llm.engine.stats.to_dict()["speculation"]["sources"]["finished"]["accepted"] > 0


def test_grammar_forced_tokens_are_drafts(text_llm):
    """A JSON schema's keys and punctuation are forced: drafted and accepted, the records unchanged."""
    tight = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    loose = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(max_tokens=40, structured_outputs=tight, logprobs=2),
        SamplingParams(max_tokens=40, structured_outputs=tight, seed=4, temperature=0.9, n=2, logprobs=1),
        SamplingParams(max_tokens=40, structured_outputs=loose, seed=2, temperature=0.5),
    ]
    llm = same_on_and_off(text_llm, [PROMPTS[0]] * len(params), params)
    assert accepted(llm, "grammar") > 0


def test_new_sources_under_preemption(text_llm):
    """Finished-line and grammar drafts in a pool small enough to preempt: records unchanged."""
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(max_tokens=40, seed=i % 2, temperature=0.5, n=2) for i in range(4)]
    params += [SamplingParams(max_tokens=40, structured_outputs=so, n=2, seed=3, temperature=0.7)] * 2
    prompts = [PROMPTS[i % 2] for i in range(4)] + [PROMPTS[2]] * 2
    llm = same_on_and_off(text_llm, prompts, params, num_blocks=12)
    assert llm.engine.stats.preemptions > 0
    assert accepted(llm, "finished") > 0 and accepted(llm, "grammar") > 0


def test_bfloat16(text_model, monkeypatch):
    base = LLM(str(text_model), device="cpu", num_blocks=64, dtype="bfloat16")
    params = [
        SamplingParams(max_tokens=30, logprobs=2),
        SamplingParams(max_tokens=30, seed=3, temperature=0.6, n=2),
    ]
    llm = same_on_and_off(base, PROMPTS[:2], params, monkeypatch)
    assert accepted(llm) > 0


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_weight_types(kind, gguf_dir, monkeypatch):
    from test_gguf_types import gguf_file

    base = LLM(str(gguf_file(gguf_dir, "llama", True, lambda name: kind, kind)), num_blocks=64, dtype="auto")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 12)]
    params = [
        SamplingParams(max_tokens=16, logprobs=2),
        SamplingParams(max_tokens=16, seed=5, temperature=0.9, n=2),
    ]
    llm = same_on_and_off(base, prompts, params, monkeypatch)
    assert llm.engine.loaded.model.lm_head.kinds == [kind]
    assert accepted(llm) > 0


def test_finished_lines_keep_the_latest_and_drop_the_oldest():
    lines = FinishedLines(1, 2, capacity=2)
    lines.add([1, 2, 3])
    lines.add([1, 2, 4])
    assert lines.follow((1, 2), 5) == [4]  # the latest line holding it
    assert lines.follow((2, 3), 5) is None  # 3 ends its line: nothing followed it
    assert lines.follow((1,), 5) == [2, 4]
    lines.add([7, 8, 9])  # the first line goes
    assert len(lines.lines) == 2 and lines.follow((1, 2), 5) == [4]
    lines.add([5, 6])  # so does the second: its n-grams no other line holds are gone
    assert lines.follow((1, 2), 5) is None and lines.follow((1,), 5) is None
    assert lines.follow((7, 8), 5) == [9] and set(lines.latest) == {(7,), (8,), (7, 8), (5,)}
    off = FinishedLines(1, 2, capacity=0)
    off.add([1, 2, 3])
    assert off.follow((1,), 5) is None


def test_step_times_fit_a_line_through_medians():
    times = StepTimes({1: [10.0] * 3, 6: [20.0] * 3})
    assert times.fit().fixed_over_row == pytest.approx(4.0)  # 8 + 2 x rows
    for _ in range(3):
        times.add(11, 30.0)
    times.add(11, 900.0)  # a stalled step moves no median
    assert times.fit().fixed_over_row == pytest.approx(4.0)
    assert StepTimes({1: [10.0] * 3}).fit() is None  # one row count: no line
    assert StepTimes({1: [10.0] * 3, 2: [9.0] * 3}).fit().fixed_over_row > 100  # rows free


def test_step_times_read_costs_off_the_medians():
    times = StepTimes({1: [10.0] * 3, 3: [20.0, 21.0, 99.0], 5: [19.0] * 3, 7: [1.0, 2.0], 8: [30.0] * 3})
    assert times.seconds(1) == 10.0 and times.seconds(8) == 30.0
    assert times.seconds(3) == times.seconds(5) == 20.0  # out of order: pooled (a row more is never cheaper)
    assert times.seconds(2) == 15.0  # between its neighbours
    assert times.seconds(6) == pytest.approx(20.0 + 10 / 3)  # 7 holds too few times: between 5 and 8
    assert times.seconds(10) == pytest.approx(30.0 + 20 / 3)  # past the last count: the last two's line
    assert StepTimes({1: [10.0] * 3}).seconds(2) == math.inf  # one count timed: rows taken as free


def test_the_gate_refits_from_the_run_and_explores(text_llm):
    """Steps that find rows dear close the gate; a gated-off draft still runs one token now and then,
    so the times of more rows keep coming."""
    spec = SpeculativeConfig.parse(SPEC)
    engine = engine_view(text_llm, None).engine
    req = engine.add_request(engine.intake.prepare(PROMPTS[0], SamplingParams(max_tokens=5), "x"), 0)
    engine.step()
    (seq,) = req.completions
    seq.token_ids.append(req.prompt_token_ids[3])  # a 1-gram of the prompt: a match
    speculator = Speculator(spec, StepTimes())
    assert speculator.cost.fixed_over_row == math.inf  # no times yet: every draft is taken
    assert speculator.propose(seq, 4, 1) is not None
    for _ in range(8):  # a step costs 0.5 + 1 x rows: a row at acceptance 1/2 does not pay
        speculator.observe(1, 1.5)
        speculator.observe(5, 5.5)
    assert speculator.cost.fixed_over_row == pytest.approx(0.5)
    proposals = [speculator.propose(seq, 4, 1) for _ in range(EXPLORE_EVERY)]
    assert proposals[:-1] == [None] * (EXPLORE_EVERY - 1)
    assert len(proposals[-1].token_ids) == 1
    # beside 63 other sequences even free rows would not pay (4 tokens at most on 64, under the
    # margin): no row cost changes that verdict, so nothing is probed
    assert [speculator.propose(seq, 4, 64) for _ in range(2 * EXPLORE_EVERY)] == [None] * (2 * EXPLORE_EVERY)
    engine.abort_all()


def test_a_draft_free_rows_would_not_pay_for_is_never_priced():
    """`could_pay`: whether a draft could beat the bar were its rows free; where not, `draft_length`
    refuses it at any row cost."""
    step = RowCost(9.0).seconds  # 9 fixed + 1 a row
    assert not could_pay(1.0, 5, 64, step)  # 69 tokens in 73 at best, against 64 in 73 by 10%
    assert could_pay(1.0, 5, 8, step) and draft_length(1.0, 5, 8, step) == 5
    assert not could_pay(0.05, 5, 8, step)  # a low rate: 8.05 tokens in 17 at best
    for seqs, rate in ((64, 1.0), (8, 0.05)):  # refused however cheap rows are
        assert draft_length(rate, 5, seqs, step) == draft_length(rate, 5, seqs, RowCost(1e9).seconds) == 0
    assert could_pay(0.01, 1, 64, RowCost(math.inf).seconds)  # rows free: every draft is taken


def test_a_new_line_starts_at_its_sources_rate():
    speculator = Speculator(SpeculativeConfig.parse(SPEC), RowCost(math.inf))
    line = SimpleNamespace(request="a")
    for _ in range(3):
        speculator.verified(line, Draft("prompt_lookup", [1, 2, 3, 4]), 4, mismatch=False)
    speculator.verified(line, Draft("prompt_lookup", [1, 2]), 1, mismatch=True)
    assert speculator._line_acceptance("b", "prompt_lookup").rate == pytest.approx(14 / 16)
    assert speculator._line_acceptance("b", "siblings").rate == 0.5  # nothing drafted from it yet

"""The engine end to end on tiny models: sharing, copy-on-write, seeds, stopping, errors, statistics."""

import random
import re

import pytest
import torch
from conftest import ENGINE
from models import hf_greedy, submit

from pagedinfer import LLM, SamplingParams
from pagedinfer.config import EngineConfig
from pagedinfer.model.loader import ModelLoadError
from pagedinfer.seeding import completion_seed


@pytest.fixture(scope="module")
def llama(tiny_model):
    """Prefix caching off: these tests count sharing among one request's completions alone (across
    generate calls the cache would serve the repeated prompts; see test_prefix_cache.py)."""
    return LLM(str(tiny_model("llama")), block_size=4, num_blocks=200, enable_prefix_caching=False, **ENGINE)


def ids(n, seed=0):
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(2, 256) for _ in range(n)]}


def test_two_completions_through_the_engine(llama):
    """Seed 000's figure 6 through the real engine: 2 blocks after the prompt, 3 after both completions write."""
    engine = llama.engine
    engine.reset_stats()
    engine.enable_trace()
    try:
        submit(engine, ids(6), SamplingParams(n=2, temperature=0, max_tokens=3))
        while engine.has_unfinished:
            engine.step()
        prefill, first_write = engine.trace[0], engine.trace[1]
    finally:
        engine.scheduler.trace = engine.pool.events = None
    p0, p1 = prefill["tables"]["0/0"]
    assert prefill["tables"]["0/1"] == [p0, p1]
    assert prefill["ref_counts"] == {p0: 2, p1: 2}  # both completions point at both prompt blocks
    assert len(first_write["copies"]) == 1  # completion 0 copies the shared partial block...
    src, dst = first_write["copies"][0]
    assert src == p1
    assert first_write["tables"]["0/0"] == [p0, dst]
    assert first_write["tables"]["0/1"] == [p0, p1]  # ...completion 1 then writes P1 in place
    assert first_write["ref_counts"] == {p0: 2, p1: 1, dst: 1}
    assert engine.stats.blocks_used[:2] == [2, 3]
    assert engine.stats.cow_copies == 1
    assert engine.pool.num_used == 0


def test_b_and_c_admitted_together(tiny_model):
    """Seed 000: with 6 blocks of 4 slots, B (6 K/V, growing) and C (6-token prompt) run side by side."""
    llm = LLM(str(tiny_model("llama")), block_size=4, num_blocks=6, max_model_len=20, **ENGINE)
    engine = llm.engine
    b = submit(engine, ids(6, 1), SamplingParams(temperature=0, max_tokens=6))
    engine.step()  # B's prompt: 6 K/V in 2 blocks
    assert engine.stats.naive_max_seqs == 1  # reserving 20 slots per sequence leaves no room for C
    submit(engine, ids(6, 2), SamplingParams(temperature=0, max_tokens=2))
    engine.step()  # B writes its 7th K/V, C its 6 prompt K/V
    assert engine.stats.blocks_used[-1] == 4
    assert engine.stats.slots_filled[-1] == 13  # 16 slots allocated, 3 still empty
    table = b.completions[0].block_table
    assert len(table) == 2 and engine.pool.slot(table, 6) == table[1] * 4 + 2
    engine.step()  # B: 8 K/V, still 2 blocks
    assert len(b.completions[0].block_table) == 2
    engine.step()  # B: 9 K/V, one new block
    assert len(b.completions[0].block_table) == 3
    while engine.has_unfinished:
        engine.step()
    assert engine.pool.num_used == 0 and engine.stats.preemptions == 0


def test_n_greedy_completions_equal_n1_and_prompt_computed_once(llama):
    prompt = ids(13, 3)
    one = llama.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    four = llama.generate(prompt, SamplingParams(n=4, temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert [o.token_ids for o in four.outputs] == [one.outputs[0].token_ids] * 4
    assert [o.index for o in four.outputs] == [0, 1, 2, 3]
    eight = llama.generate(prompt, SamplingParams(n=8, temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(eight.outputs) == 8
    assert llama.stats.prompt_tokens_computed == 13  # prefilled once, not 8 times
    assert llama.stats.prompt_tokens_requested == 8 * 13
    # 3 full prompt blocks are shared by all 8 completions; the partial one is copied by 7 of them
    assert llama.stats.cow_copies == 7
    assert llama.stats.blocks_saved_by_sharing == 8 * 4 - (3 + 8)


def test_seeded_sampling_is_reproducible_alone_and_amid_others(llama):
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=10, seed=1234)
    alone = llama.generate(ids(11, 5), params, use_tqdm=False)[0]
    again = llama.generate(ids(11, 5), params, use_tqdm=False)[0]
    others = [ids(5 + i, 100 + i) for i in range(10)]
    mixed = llama.generate(
        [*others[:4], ids(11, 5), *others[4:]],
        [SamplingParams(temperature=1.0, max_tokens=12)] * 4 + [params] + [SamplingParams(max_tokens=6)] * 6,
        use_tqdm=False,
    )[4]
    tokens = [o.token_ids for o in alone.outputs]
    assert tokens == [o.token_ids for o in again.outputs] == [o.token_ids for o in mixed.outputs]
    assert len({tuple(t) for t in tokens}) > 1  # the completions differ from each other


def test_same_seed_gives_different_prompts_different_noise():
    def noise(prompt, index, seed=7):
        gen = torch.Generator().manual_seed(completion_seed(seed, index, prompt))
        return torch.empty(16).exponential_(generator=gen)

    assert torch.equal(noise([1, 2, 3], 0), noise([1, 2, 3], 0))
    assert not torch.equal(noise([1, 2, 3], 0), noise([1, 2, 4], 0))
    assert not torch.equal(noise([1, 2, 3], 0), noise([1, 2, 3], 1))
    assert not torch.equal(noise([1, 2, 3], 0), noise([1, 2, 3], 0, seed=8))


def test_top_k_1_and_tiny_top_p_equal_greedy(llama):
    greedy = llama.generate(ids(9, 8), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    for params in (
        SamplingParams(temperature=1.5, top_k=1, max_tokens=8, seed=1),
        SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=8, seed=2),
        SamplingParams(temperature=1.5, min_p=1.0, max_tokens=8, seed=3),
    ):
        out = llama.generate(ids(9, 8), params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == greedy.outputs[0].token_ids, params


def test_logprobs(llama):
    out = llama.generate(ids(7, 9), SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[
        0
    ]
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for token, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert entry[token].rank == 1  # greedy picks the most likely token
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
        best = max(lp.logprob for lp in entry.values())
        assert entry[token].logprob == best
    assert c.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True))
    )
    plain = llama.generate(ids(7, 9), SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert plain.outputs[0].token_ids == c.token_ids
    assert plain.outputs[0].cumulative_logprob is None and plain.outputs[0].logprobs is None  # as in vLLM


def test_sampler_and_attention_plan_make_tensors_beside_their_inputs(tiny_model, monkeypatch):
    """CI has no GPU, so a tensor made without ``device=`` (on the host, beside CUDA logits or a CUDA
    pool) would only fail on one: here every such tensor lands on "meta" and fails the step instead."""
    from pagedinfer.attention import interface as attention
    from pagedinfer.engine import llm_engine as engine

    # no prefix cache: the second run must compute exactly what the first did (bit-equal logprobs)
    llm = LLM(str(tiny_model("llama")), block_size=4, num_blocks=200, enable_prefix_caching=False, **ENGINE)
    prompts = [ids(6, 1), ids(9, 2)]
    every_feature = SamplingParams(
        n=2, temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.2, presence_penalty=0.5,
        frequency_penalty=0.3, min_tokens=3, logprobs=2, seed=7, max_tokens=6,
    )  # fmt: skip
    params = [every_feature, SamplingParams(temperature=0, max_tokens=6, logprobs=1)]
    expected = llm.generate(prompts, params, use_tqdm=False)

    def on_meta(fn):
        def wrapped(*args, **kwargs):
            with torch.device("meta"):
                return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(engine, "sample", on_meta(engine.sample))
    monkeypatch.setattr(
        attention.PortablePlan, "build", classmethod(on_meta(attention.PortablePlan.build.__func__))
    )
    monkeypatch.setattr(attention.PortablePlan, "attend", on_meta(attention.PortablePlan.attend))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in expected
    ]
    assert [[c.logprobs for c in o.outputs] for o in got] == [
        [c.logprobs for c in o.outputs] for o in expected
    ]


def test_stop_token_ids_and_max_tokens(llama):
    base = llama.generate(ids(10, 11), SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    tokens = base.outputs[0].token_ids
    cut = next(i for i in range(2, 10) if tokens[i] not in tokens[:i])
    out = llama.generate(
        ids(10, 11),
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[tokens[cut]]),
        use_tqdm=False,
    )[0]
    c = out.outputs[0]
    assert c.token_ids == tokens[: cut + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", tokens[cut])
    assert base.outputs[0].finish_reason == "length"


def test_repetition_penalty_changes_greedy_choice(llama):
    prompt = ids(10, 11)
    base = llama.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    tokens = base.outputs[0].token_ids
    assert len(set(tokens)) < len(tokens)  # the random model repeats itself...
    pen = llama.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=12, presence_penalty=2.0, repetition_penalty=5.0),
        use_tqdm=False,
    )[0]
    assert len(set(pen.outputs[0].token_ids)) > len(set(tokens))  # ...less so when penalised


def test_too_long_and_too_big_requests_fail_alone(tiny_model):
    llm = LLM(str(tiny_model("llama")), block_size=4, num_blocks=10, **ENGINE)
    outs = llm.generate(
        [ids(300), ids(30), ids(5)],
        [
            SamplingParams(max_tokens=4),
            SamplingParams(max_tokens=20),
            SamplingParams(temperature=0, max_tokens=4),
        ],
        use_tqdm=False,
    )
    assert "300 tokens" in outs[0].error and "context is 256" in outs[0].error
    assert "KV blocks" in outs[1].error and "pool has 10" in outs[1].error
    assert outs[0].outputs == [] and outs[1].outputs == []
    assert outs[2].error is None
    assert outs[2].outputs[0].token_ids == hf_greedy(tiny_model("llama"), ids(5)["prompt_token_ids"], 4)
    assert llm.stats.failed_requests == 2


def test_a_too_long_prompt_names_max_model_len_when_it_set_the_context(tiny_model, text_model):
    """The error points at what to raise: the setting when it lowered the context, else the model."""
    setting = "--max-model-len (API: max_model_len)"
    llm = LLM(str(tiny_model("llama")), block_size=4, num_blocks=20, max_model_len=8, **ENGINE)
    (out,) = llm.generate([ids(10)], SamplingParams(max_tokens=2), use_tqdm=False)
    assert out.error == (
        f"the prompt has 10 tokens; the context is 8 tokens by {setting} (one more is needed to generate)"
    )
    full = LLM(str(tiny_model("llama")), block_size=4, num_blocks=20, max_model_len=256, **ENGINE)
    (out,) = full.generate([ids(300)], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "; the model's context is 256 tokens (one more" in out.error and "max_model_len" not in out.error
    text = LLM(str(text_model), block_size=4, num_blocks=20, max_model_len=4, **ENGINE)
    (out,) = text.generate(["x" * 10**6], SamplingParams(max_tokens=2), use_tqdm=False)
    assert f"characters: more than the context of 4 tokens by {setting} can hold" in out.error


def test_max_model_len_above_the_models_context_warns_and_is_capped(tiny_model):
    import warnings

    from pagedinfer.engine.llm_engine import MaxModelLenCapped

    path = str(tiny_model("llama"))  # context 256
    with pytest.warns(MaxModelLenCapped) as caught:
        llm = LLM(path, block_size=4, num_blocks=20, max_model_len=100000, **ENGINE)
    assert [str(w.message) for w in caught] == [
        "max_model_len 100000 is above the model's context (256 tokens): using 256"
    ]
    assert caught[0].filename == __file__  # points at the LLM(...) call
    assert llm.engine.max_model_len == 256
    with warnings.catch_warnings():
        warnings.simplefilter("error", MaxModelLenCapped)
        for given in (None, 256, 8):
            assert LLM(
                path, block_size=4, num_blocks=20, max_model_len=given, **ENGINE
            ).engine.max_model_len == (given or 256)


@pytest.mark.parametrize("prompts", [None, 7, b"ROMEO:"])
def test_prompts_that_are_not_prompts_are_a_type_error_saying_what_prompts_are(llama, prompts):
    words = (
        r"prompts must be a prompt \(a string, or a dict with 'prompt', 'prompt_token_ids' or 'messages'\)"
    )
    with pytest.raises(TypeError, match=rf"^{words} or a list of them, not {type(prompts).__name__}$"):
        llama.generate(prompts, use_tqdm=False)
    with pytest.raises(TypeError, match=words):
        next(llama.generate_iter(prompts))


@pytest.mark.parametrize("messages", [None, "hello", 3])
def test_chat_messages_that_are_not_conversations_are_a_type_error(llama, messages):
    with pytest.raises(
        TypeError, match=rf"^messages must be a conversation .* not {type(messages).__name__}$"
    ):
        llama.chat(messages, use_tqdm=False)


@pytest.mark.parametrize("length", [0, -1, True, 2.5])
def test_max_model_len_that_is_not_a_positive_integer_is_refused(length):
    with pytest.raises(
        ValueError,
        match=rf"^max_model_len must be an integer >= 1, not {re.escape(repr(length))} \(unset: the model's context\)$",
    ):
        EngineConfig(max_model_len=length)


def test_generate_takes_prompts_from_a_generator(llama):
    params = SamplingParams(temperature=0, max_tokens=2)
    listed = llama.generate([ids(3), ids(4)], params, use_tqdm=False)
    generated = llama.generate((p for p in [ids(3), ids(4)]), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in generated] == [o.outputs[0].token_ids for o in listed]


def test_sampling_params_that_are_not_params_are_named(llama):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams .* not a dict"):
        llama.generate([ids(3)], {"max_tokens": 2}, use_tqdm=False)
    outs = llama.generate([ids(3), ids(4)], [{"max_tokens": 2}, SamplingParams(max_tokens=2)], use_tqdm=False)
    assert outs[0].error == "sampling_params must be a SamplingParams or BeamSearchParams, not dict"
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 2


def test_text_prompts_stop_strings_and_eos(text_model):
    llm = LLM(str(text_model), block_size=4, num_blocks=100, **ENGINE)
    tok = llm.tokenizer
    assert llm.get_tokenizer() is tok and tok("hello")["input_ids"]  # vLLM's name for it
    base = llm.generate(
        "hello world", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    text = base[0].outputs[0].text
    # random tokens may end inside a UTF-8 character: those bytes are held back, never half-emitted
    assert text == tok.decode(base[0].outputs[0].token_ids, skip_special_tokens=True).rstrip("\ufffd")
    stop = next(
        text[i : i + 2]
        for i in range(3, len(text) - 2)
        if text[i : i + 2].isprintable()
        and "\ufffd" not in text[i : i + 2]
        and text[i : i + 2] not in text[: i + 1]
    )
    out = llm.generate(
        "hello world", SamplingParams(temperature=0, max_tokens=16, stop=[stop]), use_tqdm=False
    )
    c = out[0].outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == text[: text.index(stop)]
    kept = llm.generate(
        "hello world",
        SamplingParams(temperature=0, max_tokens=16, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert kept[0].outputs[0].text == text[: text.index(stop) + len(stop)]


def test_eos_stops_unless_ignored_and_min_tokens(text_model):
    llm = LLM(str(text_model), block_size=4, num_blocks=100, **ENGINE)
    base = llm.generate("안녕", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    tokens = base[0].outputs[0].token_ids
    cut = next(i for i in range(2, 12) if tokens[i] not in tokens[:i])
    eos = llm.engine.loaded.eos_token_ids  # the one set the sampler and the scheduler read
    eos.clear()
    eos.add(tokens[cut])  # the model's EOS is now a token it emits at `cut`
    out = llm.generate("안녕", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: cut + 1] and out.finish_reason == "stop"
    held = llm.generate(
        "안녕", SamplingParams(temperature=0, max_tokens=12, min_tokens=cut + 2), use_tqdm=False
    )
    assert held[0].outputs[0].token_ids[:cut] == tokens[:cut]
    assert tokens[cut] not in held[0].outputs[0].token_ids[: cut + 2]
    ignored = llm.generate(
        "안녕", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    assert ignored[0].outputs[0].token_ids == tokens


def test_prompts_need_a_tokenizer_or_ids(tiny_model):
    llm = LLM(str(tiny_model("llama")), num_blocks=8, **ENGINE)
    # each bad prompt fails alone, with its reason; the good one completes
    text, ids, good = llm.generate(
        ["hello", {"prompt_token_ids": [1, 999]}, {"prompt_token_ids": [1, 2]}],
        SamplingParams(max_tokens=2, ignore_eos=True),
        use_tqdm=False,
    )
    assert "no tokenizer" in text.error and text.outputs == []
    assert ids.error.startswith("prompt_token_ids must be a list of integers in [0, ")
    assert good.error is None and len(good.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "family,config",
    [
        ("bloom", lambda tf: tf.BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=64)),
        (
            "gpt_neo",
            lambda tf: tf.GPTNeoConfig(
                hidden_size=32,
                num_layers=2,
                attention_types=[[["global", "local"], 1]],
                num_heads=2,
                vocab_size=64,
            ),
        ),
        (
            "falcon",
            lambda tf: tf.FalconConfig(
                hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64
            ),
        ),
        ("mamba", lambda tf: tf.MambaConfig(hidden_size=32, num_hidden_layers=1, vocab_size=64)),
    ],
)
def test_unsupported_families_are_refused_by_name(tmp_path, family, config):
    import transformers as tf

    config(tf).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=f"'{family}'"):
        LLM(str(tmp_path), num_blocks=8)


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_detokenizer_never_emits_half_a_character(text_model):
    from transformers import AutoTokenizer

    from pagedinfer.engine.detokenizer import IncrementalDetokenizer

    tok = AutoTokenizer.from_pretrained(text_model)
    text = "안녕하세요 반갑습니다 😀🎉 done"
    token_ids = tok(text)["input_ids"]
    detok = IncrementalDetokenizer(tok.backend_tokenizer, [], True, [], False)
    chunks = []
    for t in token_ids:
        before = detok.text
        assert detok.step(t) is None
        chunks.append(detok.text[len(before) :])
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)
    assert sum(len(t) > 1 for t in tok.convert_ids_to_tokens(token_ids)) < len(token_ids)  # bytes split chars
    stopper = IncrementalDetokenizer(tok.backend_tokenizer, [], True, ["반갑", "😀"], False)
    for t in token_ids:
        if (hit := stopper.step(t)) is not None:
            break
    assert hit == "반갑" and stopper.text == "안녕하세요 "


def test_a_request_whose_detokenizer_raises_fails_alone(text_model, monkeypatch):
    from pagedinfer.engine.detokenizer import IncrementalDetokenizer

    llm = LLM(str(text_model), block_size=4, num_blocks=100, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=6)
    expected = llm.generate(["안녕", "hello"], params, use_tqdm=False)
    real_step = IncrementalDetokenizer.step

    def step(self, token_id):
        if self._stop == ["never-seen"]:  # only the request that asked for this stop string breaks
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "broken tokenizer")
        return real_step(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "step", step)
    broken = SamplingParams(temperature=0, max_tokens=6, stop=["never-seen"])
    outs = llm.generate(["안녕", "hello", "안녕"], [params, broken, params], use_tqdm=False)
    assert outs[1].error.startswith("generation failed: UnicodeDecodeError")
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_a_request_whose_sampling_raises_fails_alone(llama, monkeypatch):
    from pagedinfer.engine import llm_engine
    from pagedinfer.model.sampler import sample as real_sample

    def sample(logits, rows, eos_ids):
        if any(r.params.top_k == 7 for r in rows):
            raise RuntimeError("selected index k out of range")
        return real_sample(logits, rows, eos_ids)

    greedy = SamplingParams(temperature=0, max_tokens=5)
    expected = llama.generate([ids(5, 1), ids(9, 2)], greedy, use_tqdm=False)
    monkeypatch.setattr(llm_engine, "sample", sample)
    bad = SamplingParams(temperature=1.0, top_k=7, max_tokens=5)
    outs = llama.generate([ids(5, 1), ids(7, 3), ids(9, 2)], [greedy, bad, greedy], use_tqdm=False)
    assert outs[1].error == "the engine failed on this request: RuntimeError: selected index k out of range"
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [e.outputs[0].token_ids for e in expected]
    assert llama.engine.pool.num_free == llama.engine.pool.num_blocks

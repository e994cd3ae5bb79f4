"""The logits pipeline: logit controls against transformers' own processors, structured outputs, prompt
logprobs against a full forward pass, and each bad value an error for its request alone."""

from __future__ import annotations

import copy
import json
import random
import re

import jsonschema
import pytest
import torch
from conftest import ENGINE
from models import _hf_model, hf_greedy

from pagedinfer import LLM, BeamSearchParams, SamplingParams
from pagedinfer.lines.openai_params import openai_echo, openai_response_format
from pagedinfer.sampling_params import StructuredOutputsParams

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def text_llm(text_model) -> LLM:
    return LLM(str(text_model), **ENGINE)


@pytest.fixture(scope="module")
def text_prompts(text_llm) -> list[list[int]]:
    tok = text_llm.tokenizer
    return [
        tok("hello world")["input_ids"],
        tok("the quick brown")["input_ids"],
        tok("emoji time")["input_ids"],
    ]


def hf_generate(path, prompt: list[int], **processors) -> list[int]:
    """transformers' greedy ``generate`` with its own logits processors, EOS ignored."""
    return hf_greedy(path, prompt, MAX_TOKENS, **processors)


def greedy(llm: LLM, prompts: list[list[int]], **fields) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **fields)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs]


# -- logit controls against transformers ------------------------------------------------------------
def test_logit_bias_equals_sequence_bias(text_llm, text_model, text_prompts):
    plain = greedy(text_llm, text_prompts)
    for prompt, free in zip(text_prompts, plain, strict=True):
        # push the free run's 3rd token down and two others up: the output must change
        bias = {free[2]: -100.0, (free[2] + 7) % 320: 6.5, 11: 3.0}
        got = greedy(text_llm, [prompt], logit_bias={str(t): b for t, b in bias.items()})[0]
        want = hf_generate(text_model, prompt, sequence_bias=[[[t], b] for t, b in bias.items()])
        assert got == want
        assert got != free


def test_allowed_token_ids_equal_prefix_allowed_tokens_fn(text_llm, text_model, text_prompts):
    allowed = list(range(40, 120, 3))
    for prompt in text_prompts:
        got = greedy(text_llm, [prompt], allowed_token_ids=allowed)[0]
        want = hf_generate(text_model, prompt, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
        assert got == want
        assert set(got) <= set(allowed)


def test_bad_words_equal_bad_words_ids(text_llm, text_model, text_prompts):
    tok = text_llm.tokenizer
    banned = text_llm.engine.logits.processors[1]  # BadWords

    def words_of(ids: list[int], size: int) -> list[str]:
        """Spans of ``size`` generated tokens that are a text tokenizing back to them."""
        spans = [ids[i : i + size] for i in range(len(ids) - size + 1)]
        words = [tok.decode(s) for s in spans if tok.encode(tok.decode(s)) == s]
        return [w for w in words if w and w.strip() == w]

    for prompt, free in zip(text_prompts, greedy(text_llm, text_prompts), strict=True):
        # a word of two generated tokens (banning its second token needs the first in the output)
        # and a word of one
        for word in (words_of(free, 2)[0], words_of(free, 1)[-1]):
            ids = banned.token_ids((word,))
            assert tok.encode(word) in ids
            got = greedy(text_llm, [prompt], bad_words=[word])[0]
            assert got == hf_generate(text_model, prompt, bad_words_ids=ids)
            assert got != free


def test_bad_words_are_tokenized_with_and_without_a_leading_space(text_llm):
    tok = text_llm.tokenizer
    ids = text_llm.engine.logits.processors[1].token_ids(("world",))
    alone, spaced = tok.encode("world"), tok.encode(" world")
    assert ids == [alone, spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [alone]


# -- structured outputs -------------------------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def structured(llm: LLM, prompts, n: int = 4, max_tokens: int = 80, **so) -> list:
    params = [
        SamplingParams(n=n, temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=so)
        for s in range(len(prompts))
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [c for o in outs for c in o.outputs]


def test_choice_yields_only_the_choices(text_llm):
    choices = ["yes", "no", "not sure"]
    got = structured(text_llm, ["hello world", "the quick", "emoji"], choice=choices)
    assert all(c.text in choices and c.finish_reason == "stop" for c in got)
    assert len({c.text for c in got}) > 1  # the completions (each its own matcher) differ


def test_regex_outputs_match(text_llm):
    pattern = r"[a-c]{2}-[0-9]{2,4}(x|yz)"
    got = structured(text_llm, ["hello world", "the quick"], regex=pattern)
    assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in got), [
        c.text for c in got
    ]


def test_json_schema_outputs_parse_and_validate(text_llm):
    got = structured(
        text_llm, ["hello world", "the quick", "emoji time"], json=SCHEMA, disable_any_whitespace=True
    )
    for c in got:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_grammar_gbnf_and_lark(text_llm):
    gbnf = 'root ::= "(" [0-9]+ ("+" [0-9]+)? ")"'
    lark = 'start: "<" WORD ">"\nWORD: /[a-e]{1,3}/'
    for grammar, pattern in ((gbnf, r"\([0-9]+(\+[0-9]+)?\)"), (lark, r"<[a-e]{1,3}>")):
        got = structured(text_llm, ["hello"], n=3, max_tokens=20, grammar=grammar)
        assert all(re.fullmatch(pattern, c.text) for c in got if c.finish_reason == "stop"), [
            c.text for c in got
        ]
        assert any(c.finish_reason == "stop" for c in got)


def test_max_tokens_mid_object_is_length(text_llm):
    got = structured(text_llm, ["hello"], n=2, max_tokens=3, json=SCHEMA)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 3 for c in got)
    assert all(c.text.startswith("{") for c in got)


def test_one_compile_per_distinct_constraint(text_llm):
    text_llm.generate(
        ["a", "b", "c"],
        SamplingParams(max_tokens=4, structured_outputs={"regex": "[0-9]{2}zz"}),
        use_tqdm=False,
    )
    s = text_llm.stats.structured
    assert (s.compiles, s.cache_hits) in ((1, 2), (0, 3))  # (0, 3): an earlier test compiled it
    assert text_llm.stats.to_dict()["structured_outputs"]["masks"] == s.masks > 0


def test_structured_survives_preemption_and_equals_an_unpreempted_run(text_model):
    prompts = ["hello world", "the quick brown", "emoji time", "hello"]
    so = {"json": SCHEMA, "disable_any_whitespace": True}
    params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=24, structured_outputs=so)
    roomy = LLM(str(text_model), **ENGINE).generate(prompts, params, use_tqdm=False)
    small = LLM(str(text_model), num_blocks=18, block_size=4, **ENGINE)
    tight = small.generate(prompts, params, use_tqdm=False)
    assert small.stats.preemptions > 0
    assert all(o.error is None for o in roomy + tight)
    for a, b in zip(roomy, tight, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for c in b.outputs:
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), SCHEMA)


def test_beam_search_follows_the_constraint(text_llm):
    choices = ["yes", "no", "maybe", "never again"]
    params = BeamSearchParams(beam_width=3, max_tokens=10, structured_outputs={"choice": choices})
    out = text_llm.beam_search(["hello world"], params, use_tqdm=False)[0]
    assert out.error is None
    assert out.sequences and all(s.text in choices for s in out.sequences)


# -- prompt logprobs ----------------------------------------------------------------------------------
def check_prompt_logprobs(path, prompts, outs, k: int) -> None:
    # the exact values (float64): ours are ~5e-6 off (99% of 2,000 entries; the worst 1.2e-5, as the
    # sums' order falls); transformers' own float32, summed in another order, is as far off again
    model = copy.deepcopy(_hf_model(str(path))).double()
    for prompt, out in zip(prompts, outs, strict=True):
        assert (
            out.error is None and len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        )
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)  # [P, V] float64
        for i in range(1, len(prompt)):
            entry, row = out.prompt_logprobs[i], ref[i - 1]
            assert entry[prompt[i]].logprob == pytest.approx(row[prompt[i]].item(), abs=2e-5)
            assert entry[prompt[i]].rank == int((row > row[prompt[i]]).sum()) + 1
            top = row.topk(k)
            ranked = {t: lp for t, lp in entry.items() if lp.rank <= k}
            assert list(ranked) == top.indices.tolist() or len(ranked) == k  # ties aside, the same top k
            for t, lp in ranked.items():
                assert lp.logprob == pytest.approx(row[t].item(), abs=1e-5)


def test_prompt_logprobs_equal_a_full_forward_pass(tiny_model):
    path = tiny_model("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (45, 70, 33)]
    prompts.append(prompts[1][:40] + [5, 6, 7])  # its first 5 blocks of 8 are prompt 1's
    llm = LLM(str(path), max_num_batched_tokens=16, block_size=8, **ENGINE)  # every prompt spans chunks
    params = SamplingParams(n=2, temperature=0, max_tokens=2, prompt_logprobs=3)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_prompt_logprobs(path, prompts, first, 3)
    computed = llm.stats.prompt_tokens_computed
    assert llm.stats.prefix_cache_hits >= 40  # prompt 4 took prompt 1's blocks, with their logprobs
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # all cached
    check_prompt_logprobs(path, prompts, again, 3)
    assert llm.stats.prompt_tokens_computed < computed / 4
    assert [o.prompt_logprobs for o in again] == [o.prompt_logprobs for o in first]
    bigger = llm.generate(
        [{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=1, prompt_logprobs=6), use_tqdm=False
    )  # kept with a smaller k: computed again
    check_prompt_logprobs(path, prompts[:1], bigger, 6)


def test_prompt_logprobs_without_prefix_caching(tiny_model):
    path = tiny_model("llama")
    prompts = [[(7 * i) % 250 + 1 for i in range(37)]]
    llm = LLM(str(path), max_num_batched_tokens=8, enable_prefix_caching=False, **ENGINE)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    check_prompt_logprobs(path, prompts, outs, 0)
    assert all(len(e) == 1 for e in outs[0].prompt_logprobs[1:])  # k=0: the token itself


# -- errors -------------------------------------------------------------------------------------------
def test_bad_values_fail_their_request_alone(text_llm):
    outs = text_llm.generate(
        ["a", "b", "c", "d", "e"],
        [
            SamplingParams(
                max_tokens=2,
                structured_outputs={"json": {"type": "object", "properties": {"x": {"type": "nonsense"}}}},
            ),
            SamplingParams(max_tokens=2, logit_bias={"99999": 1}),
            SamplingParams(max_tokens=2, allowed_token_ids=[3, 100000]),
            SamplingParams(max_tokens=2, structured_outputs={"regex": "(unclosed"}),
            SamplingParams(max_tokens=2),
        ],
        use_tqdm=False,
    )
    assert outs[0].error.startswith("structured_outputs.json:") and "nonsense" in outs[0].error
    assert outs[1].error == "logit_bias names token 99999, outside the model's vocabulary of 320 tokens"
    assert outs[2].error.startswith("allowed_token_ids holds 100000")
    assert outs[3].error.startswith("structured_outputs.regex:") and outs[3].error.endswith("unclosed group")
    assert outs[4].error is None and len(outs[4].outputs[0].token_ids) == 2


def test_every_token_excluded_fails_the_request_alone(text_llm, text_prompts):
    """Also with n=2: both completions lose their token in one step, and the request fails once."""
    eos = text_llm.tokenizer.eos_token_id
    for n in (1, 2):
        outs = text_llm.generate(
            [{"prompt_token_ids": p} for p in text_prompts[:2]],
            [
                SamplingParams(n=n, max_tokens=4, min_tokens=3, allowed_token_ids=[eos]),
                SamplingParams(max_tokens=3),
            ],
            use_tqdm=False,
        )
        assert outs[0].error.startswith("no token can be generated here: allowed_token_ids, min_tokens")
        assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"logit_bias": {"x": 1}},
            "logit_bias must map token ids to numbers in [-100, 100], not the key 'x'",
        ),
        (
            {"logit_bias": {"5": 101}},
            "logit_bias must map token ids to numbers in [-100, 100], not 101 for token 5",
        ),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
        ({"bad_words": "word"}, "bad_words must be a list of strings or null, not a string"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be >= 0"),
        ({"structured_outputs": {"json": "{"}}, "structured_outputs.json is not valid JSON"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs must give exactly one of",
        ),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs has unknown field 'jsn'"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice must be a non-empty list"),
        ({"structured_outputs": {"choice": ["a", 3]}}, "structured_outputs.choice must be a non-empty list"),
        (
            {"stop": ["a", 5]},
            "stop must be a string or a list of strings or null, not a list holding a number (5) at index 1",
        ),
        (
            {"stop_token_ids": [2, "3"]},
            "stop_token_ids must be a list of integers or null, not a list holding a string at index 1",
        ),
    ],
)
def test_sampling_params_refuse_bad_values_naming_the_field(fields, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**fields)
    assert str(e.value).startswith(message)


def test_sampling_params_take_json_shapes():
    p = SamplingParams(logit_bias={"12": 5, "7": -100.0}, structured_outputs={"json": '{"type": "object"}'})
    assert p.logit_bias == {12: 5.0, 7: -100.0}
    assert p.structured_outputs == StructuredOutputsParams(json={"type": "object"})


def test_openai_fields_map_onto_sampling_params():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    got = openai_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    )
    assert got == {"structured_outputs": StructuredOutputsParams(json=schema)}
    assert openai_response_format({"type": "json_object"}) == {
        "structured_outputs": StructuredOutputsParams(json_object=True)
    }
    assert openai_response_format({"type": "text"}) == {}
    with pytest.raises(
        ValueError, match=r"^response_format.type must be 'text', 'json_object', 'json_schema', not 'xml'"
    ):
        openai_response_format({"type": "xml"})
    assert openai_echo(True, 2) == {"prompt_logprobs": 2}
    assert openai_echo(True, None) == openai_echo(False, 3) == {}


def test_chat_is_generate_of_messages_prompts():
    """LLM.chat renders each conversation with the chat template, as a chat line does."""
    from cli_helpers import tiny_model

    llm = LLM(str(tiny_model()), device="cpu")
    chats = [[{"role": "user", "content": "To be?"}], [{"role": "user", "content": "Or not?"}]]
    params = SamplingParams(temperature=0, max_tokens=4)
    one = llm.chat(chats[0], params, use_tqdm=False)
    both = llm.chat(chats, params, use_tqdm=False)
    direct = llm.generate([{"messages": c} for c in chats], params, use_tqdm=False)
    assert len(one) == 1 and one[0].prompt == both[0].prompt == direct[0].prompt
    assert one[0].prompt.endswith("<|assistant|>\n")
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in direct]
    assert one[0].outputs[0].token_ids == both[0].outputs[0].token_ids

"""JSON constraints below the engine: bounded whitespace, unique keys, schemas with no finite instance and
grammars with no finite output, each checked against llguidance's matcher on a real tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import tiny_model

from pagedinfer.logits.finite_schema import endless_ref
from pagedinfer.logits.json_keys import JsonKeys, KeyGuard
from pagedinfer.logits.structured import GrammarCompiler, GrammarError
from pagedinfer.sampling_params import UNBOUNDED_JSON_WHITESPACE, StructuredOutputsParams


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model())
    return GrammarCompiler(tok, len(tok), {tok.eos_token_id})


def accepts(compiler: GrammarCompiler, so: StructuredOutputsParams, text: str) -> bool:
    matcher = compiler.template(so).deep_copy()
    ids = compiler.tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}}},
    "required": ["a", "b"],
}
VALUE = {"a": 1, "b": ["x", "y"]}
PRETTY = [json.dumps(VALUE), json.dumps(VALUE, separators=(",", ":")), json.dumps(VALUE, indent=2)]
PRETTY += [json.dumps(VALUE, indent="\t"), json.dumps({"a": {"b": {"c": 1}}}, indent=4)]
RUNS = [
    '{"a":  1, "b": []}',
    '{"a":\n\n1, "b": []}',
    '{"a": \n 1, "b": []}',
    '{"a":\n' + " " * 21 + '1, "b": []}',
]


@pytest.mark.parametrize("kind", ["json", "json_object"])
def test_json_whitespace_is_bounded_by_default_and_unbounded_on_request(compiler, kind):
    def so(**options) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            **({"json": SCHEMA} if kind == "json" else {"json_object": True}), **options
        )

    bounded, compact, free = (
        so(),
        so(disable_any_whitespace=True),
        so(whitespace_pattern=UNBOUNDED_JSON_WHITESPACE),
    )
    for text in PRETTY if kind == "json_object" else PRETTY[:4]:
        assert accepts(compiler, bounded, text) and accepts(compiler, free, text), text
        assert accepts(compiler, compact, text) == (text == PRETTY[1]), text
    for text in RUNS:  # runs of blank space: only on request
        assert not accepts(compiler, bounded, text) and accepts(compiler, free, text), text
        assert not accepts(compiler, compact, text), text
    assert accepts(compiler, so(whitespace_pattern=r"\x20{0,3}"), '{"a":   1, "b": []}')


def test_a_schemas_own_x_guidance_whitespace_wins_over_the_bounded_default(compiler):
    schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
    assert not accepts(compiler, StructuredOutputsParams(json=schema), PRETTY[0])
    assert accepts(compiler, StructuredOutputsParams(json=schema), PRETTY[1])
    schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": True}}
    assert accepts(compiler, StructuredOutputsParams(json=schema), RUNS[0])


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"json_object": True, "whitespace_pattern": " ", "disable_any_whitespace": True},
            "structured_outputs.whitespace_pattern cannot be given with disable_any_whitespace",
        ),
        ({"regex": "a", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern applies to json"),
        ({"json_object": True, "whitespace_pattern": ""}, "structured_outputs.whitespace_pattern must be"),
    ],
)
def test_whitespace_pattern_refuses_what_does_not_apply(fields, message):
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(**fields)
    assert str(e.value).startswith(message)


def test_a_bad_whitespace_pattern_is_the_requests_error(compiler):
    with pytest.raises(GrammarError) as e:
        compiler.template(StructuredOutputsParams(json_object=True, whitespace_pattern="(["))
    assert str(e.value).startswith("structured_outputs.json_object: ") and "\n" not in str(e.value)


# -- unique keys -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, repeated",
    [
        ('{"a": 1, "b": {"a": 2}, "c": [{"a": 3}, {"a": 4}]}', None),
        ('{"a": 1, "b": 2, "a": 3}', "a"),
        ('{"a": {"b": 1}, "a": 2}', "a"),
        ('{"x": "a", "a": 1, "y": "\\\\", "a": 3}', "a"),  # a value "a", an escaped backslash
        ('{"a\\"": 1, "a\\u0022": 2}', 'a"'),  # the same key, escaped two ways
        ('{"\\u00e9": 1, "é": 2}', "é"),
        ('[{"a": 1}, {"a": 1}]', None),
    ],
)
def test_json_keys_finds_a_repeated_key_however_the_text_is_split(text, repeated):
    data = text.encode()
    for size in range(1, len(data) + 1):
        keys, found = JsonKeys(), None
        for i in range(0, len(data), size):
            if (found := keys.feed(data[i : i + size])) is not None:
                break
        assert found == repeated, (size, found)


def test_key_guard_bans_only_the_tokens_closing_a_repeated_key():
    vocab = [b'"', b"a", b'a"', b'"a"', b":", b",", b"1", b'":', b'b"']
    guard = KeyGuard(len(vocab), vocab.__getitem__)
    everything = torch.tensor([(1 << len(vocab)) - 1], dtype=torch.int32)  # one word: all allowed
    keys = JsonKeys()
    keys.feed(b'{"a":1,')
    assert guard.banned(keys, everything) == [3]  # '"a"' opens and closes the key "a"
    keys.feed(b'"')
    assert guard.banned(keys, everything) == [2]  # 'a"' closes "a"; '"' and '":' close a new key ""
    keys.feed(b"a")
    assert guard.banned(keys, everything) == [0, 3, 7]  # each closes "a" first
    assert guard.banned(keys, torch.tensor([0b10], dtype=torch.int32)) == []  # only "a" allowed


# -- no finite instance ------------------------------------------------------------------------------------
NODE = {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}}


@pytest.mark.parametrize(
    "schema, ref",
    [
        ({"$defs": {"node": {**NODE, "required": ["child"]}}, "$ref": "#/$defs/node"}, "#/$defs/node"),
        ({"$defs": {"node": NODE}, "$ref": "#/$defs/node"}, None),  # the child is optional
        ({"$ref": "#"}, "#"),
        (
            {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
                "$ref": "#/$defs/a",
            },
            "#/$defs/a",
        ),
        ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "#"),
        ({"type": "array", "items": {"$ref": "#"}}, None),  # [] ends it
        (
            {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
                "required": ["kids"],
            },
            None,
        ),
        ({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, None),
        ({"properties": {"child": {"$ref": "#"}}, "required": ["child"]}, None),  # untyped: a number is one
        ({"type": "object", "required": ["x"], "additionalProperties": {"$ref": "#"}}, "#"),
        ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"$ref": "#"}, "minItems": 2}, "#"),
        ({"$defs": {"a/b": {"$ref": "#/$defs/a~1b"}}, "$ref": "#/$defs/a~1b"}, "#/$defs/a~1b"),
        ({"$defs": {"a": False}, "$ref": "#/$defs/a"}, None),  # unsatisfiable, no cycle: llguidance says so
        ({"$defs": {"a": {"$id": "x", "$ref": "#"}}, "$ref": "#/$defs/a"}, None),  # another base: not judged
    ],
)
def test_endless_ref_names_a_cycle_every_instance_must_follow(schema, ref):
    assert endless_ref(schema) == ref


@pytest.mark.parametrize(
    "so, message",
    [
        (
            {"json": {"$defs": {"node": {**NODE, "required": ["child"]}}, "$ref": "#/$defs/node"}},
            "structured_outputs.json: $ref '#/$defs/node' has no finite instance: each one must contain another",
        ),
        (
            {"grammar": "start: start"},
            "structured_outputs.grammar: the grammar accepts no output: its rules only lead back to themselves",
        ),
        (
            {"grammar": 'root ::= "(" root ")"'},
            "structured_outputs.grammar: the grammar has no finite output from here: it forces endless text",
        ),
    ],
)
def test_a_constraint_with_no_finite_output_is_a_one_line_error(compiler, so, message):
    with pytest.raises(GrammarError) as e:
        compiler.template(StructuredOutputsParams(**so))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_grammar_of_the_empty_string_alone_is_not_an_error(compiler):
    assert accepts(compiler, StructuredOutputsParams(grammar='start: ""'), "")

"""`pagedinfer run` with the logit controls, structured outputs and prompt logprobs: plain and OpenAI lines."""

from __future__ import annotations

import json
import re

import jsonschema
from cli_helpers import read_jsonl, tiny_model, write_jsonl
from typer.testing import CliRunner

from pagedinfer.cli.app import app

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["n"],
    "additionalProperties": False,
}


def test_structured_lines_and_their_errors(tmp_path):
    lines = [
        {
            "id": "c",
            "prompt": "To be",
            "n": 3,
            "temperature": 1.0,
            "structured_outputs": {"choice": ["yes", "no"]},
        },
        {"id": "r", "prompt": "To be", "structured_outputs": {"regex": "[0-9]{3}"}},
        {"id": "p", "prompt": "To be, or not", "prompt_logprobs": 1, "max_tokens": 1, "logit_bias": {"7": 2}},
        {
            "id": "bad-schema",
            "prompt": "x",
            "structured_outputs": {"json": {"type": "object", "minProperties": "x"}},
        },
        {"id": "bad-bias", "prompt": "x", "logit_bias": {"100000": 1}},
        {"id": "bad-kind", "prompt": "x", "structured_outputs": {"yaml": "a: b"}},
        {
            "custom_id": "o1",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "prompt": "To be",
                "echo": True,
                "logprobs": 1,
                "max_tokens": 30,
                "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
            },
        },
        {
            "custom_id": "o2",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "x", "response_format": {"type": "yaml"}},
        },
    ]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out, report = tmp_path / "out.jsonl", tmp_path / "report.json"
    result = CliRunner().invoke(
        app,
        ["run", str(src), "-m", str(tiny_model()), "-o", str(out), "--report-json", str(report), "--quiet"],
    )
    assert result.exit_code == 1, result.output
    recs = read_jsonl(out)
    c, r, p = recs[0], recs[1], recs[2]
    assert {o["text"] for o in c["outputs"]} <= {"yes", "no"} and len(c["outputs"]) == 3
    assert re.fullmatch("[0-9]{3}", r["outputs"][0]["text"]) and r["outputs"][0]["finish_reason"] == "stop"
    plp = p["prompt_logprobs"]
    assert plp[0] is None and len(plp) == p["usage"]["prompt_tokens"]
    assert all(e["rank"] >= 1 and len(e["top_logprobs"]) == 1 for e in plp[1:])
    assert recs[3]["error"].startswith("line 4: structured_outputs.json: ")
    assert (
        recs[4]["error"]
        == "line 5: logit_bias names token 100000, outside the model's vocabulary of 320 tokens"
    )
    assert recs[5]["error"] == "line 6: structured_outputs has unknown field 'yaml'"
    choice = recs[6]["response"]["body"]["choices"][0]
    assert choice["text"].startswith("To be")
    if choice["finish_reason"] == "stop":
        assert json.loads(choice["text"][len("To be") :])["n"] in range(100)
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    usage = recs[6]["response"]["body"]["usage"]
    assert len(lp["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"]  # the BOS token too
    assert "".join(lp["tokens"]).endswith(choice["text"])
    assert recs[7]["error"]["message"] == (
        "line 8: body.response_format.type must be 'text', 'json_object', 'json_schema', not 'yaml'"
    )
    doc = json.loads(report.read_text())["structured_outputs"]  # choice, regex, schema, the bad schema
    assert doc["grammars_compiled"] == 4 and doc["masks"] > 0 and doc["mask_s"] >= 0


def test_an_openai_body_asking_prompt_logprobs_gets_them_where_vllm_puts_them(tmp_path):
    def line(cid: str, url: str, **body) -> dict:
        return {"custom_id": cid, "method": "POST", "url": url, "body": {"max_tokens": 1, **body}}

    lines = [
        line("c", "/v1/completions", prompt="To be, or not", n=2, prompt_logprobs=1),
        line("h", "/v1/chat/completions", messages=[{"role": "user", "content": "To be"}], prompt_logprobs=0),
        line("none", "/v1/completions", prompt="To be"),
    ]
    src, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["run", str(src), "-m", str(tiny_model()), "-o", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    completions, chat, none = (r["response"]["body"] for r in read_jsonl(out))
    for choice in completions["choices"]:  # vLLM's CompletionResponseChoice.prompt_logprobs
        plp = choice["prompt_logprobs"]
        assert plp[0] is None and len(plp) == completions["usage"]["prompt_tokens"]
        assert all(1 <= len(e) <= 2 for e in plp[1:])  # the token itself and the top 1
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for e in plp[1:] for v in e.values())
    plp = chat["prompt_logprobs"]  # vLLM's ChatCompletionResponse.prompt_logprobs
    assert plp[0] is None and len(plp) == chat["usage"]["prompt_tokens"] and all(len(e) == 1 for e in plp[1:])
    assert "prompt_logprobs" not in none and "prompt_logprobs" not in none["choices"][0]


PERSON = {  # prompts/extraction.jsonl's schema
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def test_json_schema_lines_of_the_demo_model_finish_at_a_high_temperature(tmp_path):
    # with JSON's whitespace unbounded this weak model spent every line's 120 tokens on blank space
    def line(seed: int) -> dict:
        body = {
            "messages": [{"role": "user", "content": "Give a person as JSON with name, age and city."}],
            "temperature": 0.9,
            "seed": seed,
            "max_tokens": 120,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        }
        return {"custom_id": f"p{seed}", "method": "POST", "url": "/v1/chat/completions", "body": body}

    src, out = write_jsonl(tmp_path / "in.jsonl", [line(s) for s in range(8)]), tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["run", str(src), "-o", str(out), "--quiet"])  # the demo model
    assert result.exit_code == 0, result.output
    for rec in read_jsonl(out):
        choice = rec["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_a_json_object_never_repeats_a_key(tmp_path):
    # the biases make a repeated empty key the greedy choice: '{"":"","":"",...' without the key guard
    bias = {'"': 100, "a": 80, ",": 60, ":": 50, "}": 40}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model())
    bias = {str(tok.convert_tokens_to_ids(c)): b for c, b in bias.items()}
    so = {"response_format": {"type": "json_object"}}
    lines = [
        {
            "id": "o",
            "prompt": "To be",
            "temperature": 0,
            "max_tokens": 24,
            "logit_bias": bias,
            "structured_outputs": {"json_object": True},
        },
        {
            "custom_id": "oa",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "To be", "temperature": 0, "max_tokens": 24, "logit_bias": bias, **so},
        },
    ]
    src, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["run", str(src), "-m", str(tiny_model()), "-o", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    plain, openai = read_jsonl(out)
    want = '{"":"","a":"","aa":"","a'
    assert plain["outputs"][0]["text"] == want and plain["outputs"][0]["finish_reason"] == "length"
    assert openai["response"]["body"]["choices"][0]["text"] == want


def test_constraints_with_no_finite_output_are_their_lines_errors(tmp_path):
    node = {"type": "object", "properties": {"v": {"type": "integer"}, "child": {"$ref": "#/$defs/node"}}}
    endless = {"$defs": {"node": {**node, "required": ["child"]}}, "$ref": "#/$defs/node"}
    optional = {
        "$defs": {"node": {**node, "required": ["v"], "additionalProperties": False}},
        "$ref": "#/$defs/node",
    }
    lines = [
        {"id": "endless", "prompt": "x", "structured_outputs": {"json": endless}},
        {"id": "self", "prompt": "x", "structured_outputs": {"json": {"$ref": "#"}}},
        {"id": "optional", "prompt": "x", "max_tokens": 60, "structured_outputs": {"json": optional}},
        {"id": "rule", "prompt": "x", "structured_outputs": {"grammar": "start: start"}},
        {"id": "forced", "prompt": "x", "structured_outputs": {"grammar": 'root ::= "(" root ")"'}},
    ]
    src, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["run", str(src), "-m", str(tiny_model()), "-o", str(out), "--quiet"])
    assert result.exit_code == 1, result.output
    recs = {r["id"]: r for r in read_jsonl(out)}
    cycle = (
        "has no finite instance: each one must contain another (a reference cycle with no optional way out)"
    )
    assert recs["endless"]["error"] == f"line 1: structured_outputs.json: $ref '#/$defs/node' {cycle}"
    assert recs["self"]["error"] == f"line 2: structured_outputs.json: $ref '#' {cycle}"
    assert recs["optional"]["error"] is None and recs["optional"]["outputs"][0]["text"].startswith("{")
    assert recs["rule"]["error"] == (
        "line 4: structured_outputs.grammar: the grammar accepts no output: its rules only lead back to themselves"
    )
    assert recs["forced"]["error"] == (
        "line 5: structured_outputs.grammar: the grammar has no finite output from here: it forces endless text"
        " (a rule that must repeat)"
    )
    assert len(result.output.strip().splitlines()) == 1 + 4  # the summary, then one line per error

"""`pagedinfer run` with the logit controls, structured outputs and prompt logprobs: plain and OpenAI lines."""

from __future__ import annotations

import json
import re

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

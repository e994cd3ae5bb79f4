"""``max_logprobs`` (vLLM's name and default, 20) bounds the logprobs a request may ask per token:
``logprobs``, an OpenAI chat body's ``top_logprobs`` and ``prompt_logprobs``; a request above it fails
alone with an error naming the field, its value and the limit; -1 lifts it."""

from __future__ import annotations

import pytest
from cli_helpers import invoke, one_line_error, read_jsonl, tiny_model, write_jsonl
from conftest import ENGINE

from pagedinfer import LLM, SamplingParams
from pagedinfer.config import EngineConfig

HINT = "(raise it with --max-logprobs or LLM(max_logprobs=...); -1: no limit)"


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model())


def run(model: str, path, *args) -> object:
    return invoke("run", path, "-q", "--device", "cpu", "--model", model, *args)


def test_the_api_bounds_logprobs_at_20_by_default_and_as_given(model):
    prompt = {"prompt_token_ids": [3, 4, 5]}
    params = [
        SamplingParams(max_tokens=2, logprobs=20),
        SamplingParams(max_tokens=2, logprobs=21),
        SamplingParams(max_tokens=2, prompt_logprobs=21),
        SamplingParams(max_tokens=2, prompt_logprobs=20),
    ]
    llm = LLM(model, num_blocks=64, **ENGINE)
    outs = llm.generate([prompt] * 4, params, use_tqdm=False)
    assert [o.error for o in outs] == [
        None,
        f"logprobs=21 exceeds max_logprobs=20 {HINT}",
        f"prompt_logprobs=21 exceeds max_logprobs=20 {HINT}",
        None,
    ]
    assert len(outs[0].outputs[0].logprobs[0]) in (20, 21)  # the top 20, and the sampled token
    unbounded = LLM(model, num_blocks=64, max_logprobs=-1, **ENGINE)
    (wide,) = unbounded.generate(prompt, SamplingParams(max_tokens=1, logprobs=50), use_tqdm=False)
    assert wide.error is None and len(wide.outputs[0].logprobs[0]) >= 50
    (over,) = unbounded.generate(prompt, SamplingParams(max_tokens=1, logprobs=100_000), use_tqdm=False)
    assert over.error.startswith("logprobs=100000 exceeds the model's vocabulary of")


@pytest.mark.parametrize("value", [-2, True, 2.5, None])
def test_max_logprobs_must_be_an_integer_from_minus_one(value):
    with pytest.raises(
        ValueError, match=f"max_logprobs must be an integer >= 0, or -1 for no limit, not {value!r}"
    ):
        EngineConfig(max_logprobs=value)


def test_the_command_line_bounds_every_field_naming_it(model, tmp_path):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True}
    lines = [
        {"id": "ok", "prompt": "To be", "max_tokens": 1, "logprobs": 5},
        {"id": "plain", "prompt": "To be", "max_tokens": 1, "logprobs": 6},
        {"id": "prompt", "prompt": "To be", "max_tokens": 1, "prompt_logprobs": 7},
        {"custom_id": "completions", "url": "/v1/completions", "body": {"prompt": "To be", "logprobs": 8}},
        {
            "custom_id": "echo",
            "url": "/v1/completions",
            "body": {"prompt": "To", "echo": True, "logprobs": 9},
        },
        {"custom_id": "chat", "url": "/v1/chat/completions", "body": {**chat, "top_logprobs": 10}},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    result = run(model, path, "--max-logprobs", "5")
    assert result.exit_code == 1, result.output
    errors = {r.get("custom_id") or r["id"]: r["error"] for r in read_jsonl(tmp_path / "p.out.jsonl")}
    openai = {k: errors.pop(k)["message"] for k in ("completions", "echo", "chat")}
    assert errors == {
        "ok": None,
        "plain": f"line 2: logprobs=6 exceeds max_logprobs=5 {HINT}",
        "prompt": f"line 3: prompt_logprobs=7 exceeds max_logprobs=5 {HINT}",
    }
    assert openai == {
        "completions": f"line 4: logprobs=8 exceeds max_logprobs=5 {HINT}",
        "echo": f"line 5: logprobs=9 exceeds max_logprobs=5 {HINT}",  # the body's logprobs, asked of both
        "chat": f"line 6: logprobs=10 exceeds max_logprobs=5 {HINT}",  # top_logprobs: the per-token count
    }


def test_the_default_is_20_and_minus_one_lifts_it(model, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "To be", "max_tokens": 1, "prompt_logprobs": 64}])
    assert run(model, path).exit_code == 1
    (record,) = read_jsonl(tmp_path / "p.out.jsonl")
    assert record["error"] == f"line 1: prompt_logprobs=64 exceeds max_logprobs=20 {HINT}"
    assert run(model, path, "--max-logprobs", "-1").exit_code == 0
    (record,) = read_jsonl(tmp_path / "p.out.jsonl")
    assert all(len(entry["top_logprobs"]) == 64 for entry in record["prompt_logprobs"][1:])


def test_a_bad_value_is_one_line_and_resume_keeps_the_limit(model, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prompt_token_ids": [3, 4 + i]} for i in range(3)])
    one_line_error(
        run(model, path, "--max-logprobs", "-2"),
        "--max-logprobs must be an integer >= 0, or -1 for no limit, not -2",
    )
    assert run(model, path, "--max-logprobs", "3").exit_code == 0
    out = tmp_path / "p.out.jsonl"
    out.write_bytes(out.read_bytes().splitlines(keepends=True)[0])
    one_line_error(
        run(model, path, "--resume"),
        f"--resume: {out} was written with --max-logprobs 3; this run has --max-logprobs 20",
    )

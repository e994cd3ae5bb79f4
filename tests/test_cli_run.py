"""`pagedinfer run` end to end on tiny random-weight models (Typer's CliRunner, in process)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import read_jsonl, tiny_model, tiny_model_no_tokenizer, write_jsonl
from rich.console import Console
from typer.testing import CliRunner

from pagedinfer.cli.app import app

DOCS = Path(__file__).resolve().parent.parent / "docs" / "report.md"


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model())


def invoke(*args: str):
    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def run(model: str, path: Path, *args: str):
    return invoke("run", path, "--model", model, "--device", "cpu", "--quiet", *args)


def test_every_input_form(model, tmp_path):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be?"}]
    lines = [
        {"id": "text", "prompt": "To be, or not to be", "n": 2, "max_tokens": 3, "ignore_eos": True},
        {"messages": messages, "ignore_eos": True},
        {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 2, "ignore_eos": True, "logprobs": 2},
        {
            "custom_id": "cmpl",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "x", "prompt": "The quick", "max_tokens": 3, "logprobs": 1, "ignore_eos": True},
        },
        {
            "custom_id": "chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "x",
                "messages": messages,
                "n": 2,
                "max_completion_tokens": 2,
                "logprobs": True,
                "top_logprobs": 2,
                "ignore_eos": True,
            },
        },
    ]
    path = write_jsonl(tmp_path / "forms.jsonl", lines)
    result = run(model, path, "--max-tokens", "4")
    assert result.exit_code == 0, result.output
    text, chat, ids, cmpl, chat_oa = read_jsonl(tmp_path / "forms.out.jsonl")

    assert text["id"] == "text" and text["prompt"] == "To be, or not to be" and text["error"] is None
    assert [o["index"] for o in text["outputs"]] == [0, 1]
    assert all(len(o["token_ids"]) == 3 and o["finish_reason"] == "length" for o in text["outputs"])
    assert text["usage"]["completion_tokens"] == 6

    tok = AutoTokenizer.from_pretrained(model)
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["id"] == 2 and chat["messages"] == messages and chat["prompt"] == rendered
    assert chat["usage"]["prompt_tokens"] == len(
        tok(rendered, add_special_tokens=False)["input_ids"]
    )  # one BOS
    assert len(chat["outputs"][0]["token_ids"]) == 4  # the command-line default

    assert ids["prompt_token_ids"] == [5, 6, 7, 8] and ids["usage"]["prompt_tokens"] == 4
    step = ids["outputs"][0]["logprobs"][0]
    assert step["token_id"] == ids["outputs"][0]["token_ids"][0] and len(step["top_logprobs"]) == 2

    assert cmpl["custom_id"] == "cmpl" and cmpl["error"] is None and cmpl["response"]["status_code"] == 200
    body = cmpl["response"]["body"]
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 3
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == 3

    body = chat_oa["response"]["body"]
    assert chat_oa["custom_id"] == "chat" and body["object"] == "chat.completion"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"]["role"] == "assistant"
    content = body["choices"][0]["logprobs"]["content"]
    assert (
        len(content) == 2 and len(content[0]["top_logprobs"]) == 2 and isinstance(content[0]["bytes"], list)
    )


def test_bad_lines_get_error_records_and_good_lines_complete(model, tmp_path):
    lines = [
        {"id": "good-1", "prompt": "hello", "max_tokens": 2},
        '{"prompt": "torn',
        {"id": "no-prompt"},
        {"id": "wrong-type", "prompt": ["x"]},
        {"id": "unknown", "prompt": "x", "bogus": 1},
        {"id": "model-too-long", "prompt_token_ids": [3] * 200},
        {"id": "pool-too-long", "prompt_token_ids": [3] * 20, "max_tokens": 100},
        {"id": "vocab", "prompt_token_ids": [99999]},
        {"id": "good-2", "prompt_token_ids": [4, 5], "max_tokens": 2},
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    result = run(model, path, "--block-size", "4", "--num-blocks", "12")
    assert result.exit_code == 1
    assert "2 ok, 7 failed (lines 2, 3, 4, 5, 6, 7, 8)" in result.stdout
    records = read_jsonl(tmp_path / "bad.out.jsonl")
    assert len(records) == len(lines)
    by_line = {i + 1: r for i, r in enumerate(records)}
    assert by_line[1]["error"] is None and len(by_line[1]["outputs"][0]["token_ids"]) <= 2
    assert by_line[9]["error"] is None
    expected = {
        2: "not valid JSON",
        3: "no prompt",
        4: "prompt must be a string, not a list",
        5: "unknown field 'bogus'",
        6: "the prompt has 200 tokens; the model's context is 128 tokens",
        7: "but the pool has 12",
        8: "prompt_token_ids must be a list of integers in [0, ",
    }
    for line, reason in expected.items():
        assert by_line[line]["error"].startswith(f"line {line}: "), by_line[line]
        assert reason in by_line[line]["error"]
        assert by_line[line]["id"] == (line if line == 2 else lines[line - 1]["id"])
    for line, reason in expected.items():  # the summary names every failed line and its reason
        assert f"✗ line {line}: " in result.stdout and reason in result.stdout


def test_bad_openai_lines_get_openai_error_records(tmp_path):
    lines = [
        {"custom_id": "oa-bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": 3}},
        "{not json",
        {
            "custom_id": "oa-unknown",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [], "x": 1},
        },
    ]
    path = write_jsonl(tmp_path / "oa.jsonl", lines)
    result = invoke("run", path, "--model", "/no/such/model")  # nothing can run: the model is never loaded
    assert result.exit_code == 1
    first, torn, unknown = read_jsonl(tmp_path / "oa.out.jsonl")
    assert first["custom_id"] == "oa-bad" and first["response"]["status_code"] == 400
    assert first["error"]["message"].startswith("line 1: body.prompt must be a string")
    assert first["response"]["body"]["error"]["message"] == first["error"]["message"]
    assert (
        torn["custom_id"] is None
        and torn["response"] is None
        and torn["error"]["message"].startswith("line 2: not valid JSON")
    )
    assert unknown["custom_id"] == "oa-unknown" and "unknown body field 'x'" in unknown["error"]["message"]


def test_strict_stops_before_loading_the_model(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "x"}, "nope", {"prompt": 1}])
    result = invoke("run", path, "--model", "/no/such/model", "--strict")  # never loaded
    assert result.exit_code == 1
    assert "2 bad lines; stopping before loading the model" in result.stderr
    assert "line 2: not valid JSON" in result.stderr and "line 3: prompt must be a string" in result.stderr
    assert not (tmp_path / "s.out.jsonl").exists()


def test_strict_stops_on_lines_too_long_after_tokenization(model, tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "x"}, {"prompt_token_ids": [3] * 500}])
    result = run(model, path, "--strict")
    assert result.exit_code == 1 and "stopping before generating" in result.stderr
    assert "line 2: the prompt has 500 tokens" in result.stderr


def _one_line_error(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in " ".join(result.stderr.split()), result.stderr


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "does not exist"),
        ("directory", "is a directory"),
        ("empty", "is empty"),
        ("utf16", "is UTF-16 or UTF-32 text; save it as UTF-8"),
        ("no-output-dir", "directory"),
        ("output-is-dir", "is a directory"),
        ("output-is-input", "is the input file"),
        ("unknown-model", "model directory /no/such/model does not exist"),
        ("model-is-file", "is a file"),
        ("both-pool-sizes", "give --num-blocks or --kv-cache-memory, not both"),
        ("bad-kv-memory", "cannot read 'lots' as a size"),
        ("bad-block-size", "--block-size must be a power of two"),
        ("bad-temperature", "temperature must be >= 0"),
        ("resume-stdout", "--resume needs an output file"),
    ],
)
def test_unusable_invocations_exit_2_with_one_line(model, tmp_path, case, message):
    good = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    args = {
        "missing": [tmp_path / "nope.jsonl"],
        "directory": [tmp_path],
        "empty": [write_jsonl(tmp_path / "e.jsonl", [])],
        "utf16": [tmp_path / "bin.jsonl"],
        "no-output-dir": [good, "-o", tmp_path / "missing-dir" / "o.jsonl"],
        "output-is-dir": [good, "-o", tmp_path],
        "output-is-input": [good, "-o", good],
        "unknown-model": [good, "--model", "/no/such/model"],
        "model-is-file": [good, "--model", good],
        "both-pool-sizes": [good, "--num-blocks", "4", "--kv-cache-memory", "1MiB"],
        "bad-kv-memory": [good, "--kv-cache-memory", "lots"],
        "bad-block-size": [good, "--block-size", "3"],
        "bad-temperature": [good, "--temperature", "-1"],
        "resume-stdout": [good, "-o", "-", "--resume"],
    }[case]
    (tmp_path / "bin.jsonl").write_bytes('{"prompt": "x"}\n'.encode("utf-16"))
    if "--model" not in args:
        args = [*args, "--model", model]
    result = invoke("run", *args)
    _one_line_error(result, message)


def test_output_order_is_input_order_when_later_lines_finish_first(model, tmp_path):
    lines = [{"id": "slow", "prompt_token_ids": [3, 4], "max_tokens": 12, "ignore_eos": True}]
    lines += [{"id": f"fast-{i}", "prompt_token_ids": [5 + i], "max_tokens": 1} for i in range(4)]
    path = write_jsonl(tmp_path / "o.jsonl", lines)
    result = invoke("run", path, "--model", model, "--quiet", "-o", "-")
    assert result.exit_code == 0
    out = [json.loads(x) for x in result.stdout.splitlines() if x.startswith("{")]
    assert [r["id"] for r in out] == ["slow", "fast-0", "fast-1", "fast-2", "fast-3"]
    assert len(out[0]["outputs"][0]["token_ids"]) == 12


class _InterruptAfter:
    """Patch LLMEngine.step to send a real SIGINT (Ctrl-C, or ``signum``) to this process at the start of
    the step ``steps``."""

    def __init__(self, monkeypatch, steps: int, signum: int = signal.SIGINT) -> None:
        from pagedinfer.engine.llm_engine import LLMEngine

        original = LLMEngine.step
        self.calls = 0

        def step(engine):
            self.calls += 1
            if self.calls == steps:
                os.kill(os.getpid(), signum)
            return original(engine)

        monkeypatch.setattr(LLMEngine, "step", step)


def test_ctrl_c_then_resume_completes_exactly_the_missing_lines(model, tmp_path, monkeypatch):
    # line 1 is long, lines 2..5 finish first: on Ctrl-C they are written (finished work is kept)
    lines = [{"id": "long", "prompt_token_ids": [3, 4, 5], "max_tokens": 30, "ignore_eos": True}]
    lines += [
        {"id": f"s{i}", "prompt_token_ids": [6, i + 7], "max_tokens": 2, "ignore_eos": True} for i in range(4)
    ]
    lines.append({"id": "bad", "prompt": 5})
    path = write_jsonl(tmp_path / "r.jsonl", lines)
    out = tmp_path / "r.out.jsonl"
    with monkeypatch.context() as m:
        _InterruptAfter(m, steps=5)
        result = run(model, path)
    assert result.exit_code == 130
    text = " ".join(result.stdout.split())
    assert "interrupted by SIGINT: 5 lines on disk in" in text
    # the signal came during step 5: the long line had its 5th token when the step finished
    assert (
        "1 line not run: 1 interrupted mid-generation (5 tokens generated, all kept for --resume); run again "
        "with --resume" in text
    )
    first = read_jsonl(out)
    assert sorted(r["id"] for r in first) == ["bad", "s0", "s1", "s2", "s3"]

    report = tmp_path / "report.json"
    result = run(model, path, "--resume", "--report-json", report)
    assert result.exit_code == 1, result.output  # line 6's error record, kept from the first run
    assert "5 already done (--resume, 1 of them error records)" in " ".join(result.stdout.split())
    doc = json.loads(report.read_text())
    assert doc["run"]["skipped"] == 5 and doc["run"]["succeeded"] == 1
    assert doc["scheduling"]["requests"] == 1  # only the missing line ran
    final = read_jsonl(out)
    assert [r["id"] for r in final] == ["long", "s0", "s1", "s2", "s3", "bad"]  # input order restored
    assert len(final[0]["outputs"][0]["token_ids"]) == 30
    assert {r["id"]: r for r in final if r["id"] != "long"} == {r["id"]: r for r in first}  # kept as written


def test_a_stop_counts_the_lines_interrupted_mid_generation_apart_from_those_not_started(
    model, tmp_path, monkeypatch
):
    """--max-num-seqs 1 (a window of 2 lines): at the stop, line 2 runs with 4 tokens, line 3 waits in
    the engine and lines 4 and 5 are not read yet."""
    lines = [{"id": "first", "prompt_token_ids": [3, 4], "max_tokens": 2, "ignore_eos": True}]
    lines += [
        {"id": f"n{i}", "prompt_token_ids": [5, 6 + i], "max_tokens": 30, "ignore_eos": True}
        for i in range(4)
    ]
    path = write_jsonl(tmp_path / "i.jsonl", lines)
    report = tmp_path / "i.json"
    with monkeypatch.context() as m:
        _InterruptAfter(m, steps=6, signum=signal.SIGTERM)  # steps 1-2: line 1; 3-6: line 2
        result = run(model, path, "--max-num-seqs", "1", "--report-json", report)
    assert result.exit_code == 143
    assert (
        "interrupted by SIGTERM: 1 line on disk in "
        f"{tmp_path / 'i.out.jsonl'}; 4 lines not run: 1 interrupted mid-generation (4 tokens generated, all "
        "kept for --resume), 3 not started; run again with --resume to complete them"
    ) in " ".join(result.stdout.split())
    doc = json.loads(report.read_text())["run"]
    assert (doc["interrupted"], doc["interrupted_lines"], doc["interrupted_tokens"]) == (True, 1, 4)


def test_resume_after_a_crash_mid_write(model, tmp_path):
    lines = [{"id": i, "prompt_token_ids": [i + 3], "max_tokens": 2} for i in range(4)]
    path = write_jsonl(tmp_path / "c.jsonl", lines)
    out = tmp_path / "c.out.jsonl"
    assert run(model, path).exit_code == 0
    complete = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(complete[:2]) + complete[2][:17])  # crashed while writing line 3
    result = run(model, path, "--resume")
    assert result.exit_code == 0
    assert out.read_bytes().splitlines(keepends=True)[:2] == complete[:2]
    assert [r["id"] for r in read_jsonl(out)] == [0, 1, 2, 3]
    assert out.read_bytes().splitlines(keepends=True) == complete  # seeds derive from ids: same results


def test_report_figures_match_the_engine_and_predicted_sharing(model, tmp_path):
    from pagedinfer import LLM, SamplingParams

    prompt_len, block_size, n, max_tokens = 10, 4, 4, 6
    ids = list(range(3, 3 + prompt_len))
    line = {
        "id": "p",
        "prompt_token_ids": ids,
        "n": n,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "seed": 1,
    }
    path = write_jsonl(tmp_path / "share.jsonl", [line])
    report = tmp_path / "share.json"
    args = ["--block-size", block_size, "--num-blocks", 64, "--report-json", report, "--report"]
    result = run(model, path, *args)
    assert result.exit_code == 0, result.output
    doc = json.loads(report.read_text())

    full_blocks = prompt_len // block_size
    assert doc["sharing"]["blocks_saved_by_sharing"] == (n - 1) * full_blocks  # = 6 blocks
    assert doc["sharing"]["cow_copies"] == (n - 1 if prompt_len % block_size else 0)
    assert doc["sharing"]["prompt_tokens_requested"] == n * prompt_len
    assert doc["sharing"]["prompt_tokens_computed"] == prompt_len
    own = -(-(prompt_len + max_tokens - 1) // block_size) - full_blocks
    assert doc["usage"]["peak_blocks_used"] == full_blocks + n * own
    assert doc["scheduling"]["peak_running_seqs"] == n
    assert doc["scheduling"]["naive_max_seqs"] == 64 * block_size // 128
    assert doc["pool"]["num_blocks"] == 64 and doc["pool"]["source"] == "num_blocks=64"
    assert doc["usage"]["blocks_used_per_step"][-1] > 0 and doc["run"]["succeeded"] == 1

    # the same run through the Python API gives the same statistics (throughput aside)
    llm = LLM(model, block_size=block_size, num_blocks=64, device="cpu")
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, seed=1)
    llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    api = llm.stats.to_dict()
    for section in ("pool", "usage", "fragmentation", "sharing", "scheduling"):
        assert doc[section] == api[section], section
    assert doc["throughput"]["generated_tokens"] == api["throughput"]["generated_tokens"] == n * max_tokens

    # the terminal report shows the same figures
    text = " ".join(result.stdout.split())
    assert "KV cache memory report" in text
    assert f"{(n - 1) * full_blocks} blocks" in text and f"{n - 1} copy-on-write copies" in text
    assert f"peak {full_blocks + n * own} blocks" in text and "sized by --num-blocks 64" in text
    assert f"{n * prompt_len} requested" in text


REPORT_KEYS = {
    "version",
    "pool",
    "pool.num_blocks",
    "pool.block_size",
    "pool.bytes_per_token",
    "pool.bytes_per_block",
    "pool.kv_bytes_total",
    "pool.source",
    "pool.max_model_len",
    "pool.kv_cache_dtype",
    "model",
    "model.dtype",
    "model.dtype_reason",
    "model.dtype_emulated",
    "model.matmul_numerics",
    "model.weight_bytes",
    "model.linear_bits_per_weight",
    "cuda_graphs",
    "cuda_graphs.mode",
    "cuda_graphs.capture_s",
    "cuda_graphs.graph_steps",
    "usage",
    "usage.steps",
    "usage.peak_blocks_used",
    "usage.peak_kv_bytes",
    "usage.mean_blocks_used",
    "usage.blocks_used_per_step",
    "layer_groups",
    "layer_groups.groups",
    "layer_groups.window_releases",
    "layer_groups.blocks_without_windows_at_peak",
    "layer_groups.blocks_used_per_step",
    "fragmentation",
    "fragmentation.empty_slots_at_peak",
    "fragmentation.empty_fraction_at_peak",
    "fragmentation.empty_fraction_mean",
    "fragmentation.naive_reserved_slots_at_peak",
    "fragmentation.naive_reserved_bytes_at_peak",
    "fragmentation.naive_waste_fraction_at_peak",
    "fragmentation.naive_waste_fraction_mean",
    "speculation",
    "speculation.mode",  # the other speculation keys only when it ran
    "sharing",
    "sharing.peak_logical_blocks",
    "sharing.blocks_saved_by_sharing",
    "sharing.cow_copies",
    "sharing.prompt_tokens",
    "sharing.prompt_tokens_requested",
    "sharing.prompt_tokens_computed",
    "sharing.prompt_tokens_saved_by_sharing",
    "sharing.prompt_tokens_saved_by_prefix_cache",
    "sharing.prompt_tokens_readmitted",
    "sharing.output_tokens_recomputed",
    "sharing.output_tokens_restored",
    "prefix_cache",
    "prefix_cache.enabled",
    "prefix_cache.queries",
    "prefix_cache.hits",
    "prefix_cache.hit_rate",
    "prefix_cache.blocks_reused",
    "prefix_cache.evictions",
    "prefix_cache.peak_cached_blocks",
    "prefix_cache.cached_blocks_per_step",
    "scheduling",
    "scheduling.policy",
    "scheduling.requests",
    "scheduling.failed_requests",
    "scheduling.completions",
    "scheduling.preemptions",
    "scheduling.peak_running_seqs",
    "scheduling.naive_max_seqs",
    "throughput",
    "lora",
    "lora.enabled",
    "lora.adapters",
    "lora.base_requests",
    "lora.base_prompt_tokens",
    "lora.base_completion_tokens",
    "lora.adapter_reads",
    "lora.slot_loads",
    "reproducibility",
    "reproducibility.covered",
    "reproducibility.why",
    "reproducibility.system_fingerprint",
    "structured_outputs",
    "structured_outputs.grammars_compiled",
    "structured_outputs.grammar_cache_hits",
    "structured_outputs.compile_s",
    "structured_outputs.masks",
    "structured_outputs.mask_s",
    "structured_outputs.mask_wait_s",
    "structured_outputs.mask_apply_s",
    "structured_outputs.mask_share_of_wall",
    "throughput.wall_time_s",
    "throughput.kernel_compile_s",
    "throughput.prompt_tokens_per_s",
    "throughput.generated_tokens",
    "throughput.completion_tokens",
    "throughput.generated_tokens_per_s",
    "derived",
    "derived.empty_bytes_at_peak",
    "derived.naive_wasted_bytes_at_peak",
    "derived.peak_filled_slots",
    "derived.peak_step",
    "derived.logical_blocks_at_max_sharing",
    "derived.physical_blocks_at_max_sharing",
    "derived.bytes_saved_by_sharing",
    "derived.prompt_tokens_saved_by_sharing",
    "derived.pool_usage_fraction_at_peak",
    "run",
    "run.input",
    "run.output",
    "run.model",
    "run.lines",
    "run.skipped",
    "run.succeeded",
    "run.failed",
    "run.failed_lines",
    "run.capped_by_max_line_tokens",
    "run.capped_by_line_timeout",
    "run.interrupted",
    "run.interrupted_lines",
    "run.interrupted_tokens",
    "run.interrupted_tokens_kept",
    "run.resumed_lines",
    "run.resumed_tokens_recovered",
    "run.resumed_tokens_recomputed",
    "run.resumed_most_tokens_recomputed",
}


def _keys(doc: dict, prefix: str = "") -> set[str]:
    keys = set()
    for k, v in doc.items():
        keys.add(prefix + k)
        if isinstance(v, dict):
            keys |= _keys(v, f"{prefix}{k}.")
    return keys


def test_report_json_keys_are_stable_and_documented(model, tmp_path):
    path = write_jsonl(tmp_path / "k.jsonl", [{"prompt": "x", "max_tokens": 2}, {"prompt": 1}])
    report = tmp_path / "k.json"
    assert run(model, path, "--report-json", report).exit_code == 1
    doc = json.loads(report.read_text())
    assert _keys(doc) == REPORT_KEYS
    assert doc["run"]["failed_lines"] == [2] and doc["scheduling"]["requests"] == 1
    documented = set(re.findall(r"`([a-z_]+(?:\.[a-z_]+)?)`", DOCS.read_text()))
    assert REPORT_KEYS - {"version"} <= documented | {k.split(".")[0] for k in REPORT_KEYS}, sorted(
        REPORT_KEYS - documented
    )
    assert {k for k in REPORT_KEYS if "." in k} <= documented, sorted(
        k for k in REPORT_KEYS if k not in documented
    )


def test_model_without_tokenizer_takes_token_ids_only(tmp_path):
    path = write_jsonl(
        tmp_path / "ids.jsonl",
        [
            {"prompt_token_ids": [3, 4], "max_tokens": 2},
            {"prompt": "text"},
            {"messages": [{"role": "user", "content": "x"}]},
        ],
    )
    result = run(str(tiny_model_no_tokenizer()), path)
    assert result.exit_code == 1
    ok, text, chat = read_jsonl(tmp_path / "ids.out.jsonl")
    assert ok["error"] is None and ok["outputs"][0]["text"] == ""
    assert "has no tokenizer" in text["error"] and "has no tokenizer" in chat["error"]


def test_progress_bar_on_a_terminal_and_silent_when_quiet(model, tmp_path):
    from pagedinfer.cli.run import RunOptions, execute

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "max_tokens": 3, "n": 2}])
    for quiet in (False, True):
        err = Console(file=io.StringIO(), force_terminal=True, width=120)
        out = Console(file=io.StringIO(), width=100)
        opts = RunOptions(
            prompts=path, model=model, quiet=quiet, engine={"device": "cpu"}, sampling={"max_tokens": 3}
        )
        assert execute(opts, out, err) == 0
        shown = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", err.file.getvalue())  # without the colours
        if quiet:
            assert shown == "" and "KV cache memory report" not in out.file.getvalue()
        else:
            last = shown.split("\r")[-1]  # the bar's final frame
            assert last.startswith("lines 1 100% read ") and "tok/s" in last, last
            assert re.search(r"KV [\d,]+/[\d,]+", last)
            assert "KV cache memory report" in out.file.getvalue()
        assert "pagedinfer: 1 line " in out.file.getvalue()


def test_version_and_help_everywhere():
    result = invoke("--version")
    assert result.exit_code == 0 and re.fullmatch(r"pagedinfer \d+\.\d+\.\d+\s*", result.stdout)
    for args in (["--help"], ["run", "--help"], ["blocks", "--help"]):
        result = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"}).invoke(app, args)
        assert result.exit_code == 0 and "Usage" in result.stdout
    help_text = (
        CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"}).invoke(app, ["run", "--help"]).stdout
    )
    options = (
        "--model -m -n --max-tokens --temperature --top-p --top-k --min-p --seed --stop --output -o --block-size "
        "--num-blocks --kv-cache-memory --max-num-seqs --max-num-batched-tokens --max-model-len --device --dtype --report "
        "--no-report --report-json --trace --resume --strict --quiet"
    )
    for option in options.split():
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", help_text), option


def test_a_pool_too_small_for_its_completions_completes_with_the_records_of_a_roomy_one(tmp_path):
    """Two lines of n=4, 20 tokens each, in 8 blocks of the demo model: sequences are preempted and
    recomputed, and some steps have no row that samples (their lm_head gets no rows; the panel GEMM
    was handed 0 rows and died of SIGFPE). The run completes with the greedy records of a pool that
    holds everything."""
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ROMEO:"}, {"prompt": "JULIET:"}])
    env = {**os.environ, "PAGEDINFER_CPU_GEMM": "panels"}  # the panel kernel on every CPU
    records = {}
    for name, pool in (("small", "8"), ("roomy", "256")):
        out, report = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.json"
        cmd = [
            sys.executable,
            "-m",
            "pagedinfer",
            "run",
            str(src),
            "-o",
            str(out),
            "--device",
            "cpu",
            "--quiet",
        ]
        cmd += ["-n", "4", "--max-tokens", "20", "--temperature", "0", "--num-blocks", pool]
        result = subprocess.run(cmd + ["--report-json", str(report)], env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-2000:]
        records[name] = read_jsonl(out)
        preemptions = json.loads(report.read_text())["scheduling"]["preemptions"]
        assert (preemptions > 0) == (name == "small")
    assert records["small"] == records["roomy"]
    assert [len(r["outputs"]) for r in records["small"]] == [4, 4]
    assert all(len(o["token_ids"]) == 20 for r in records["small"] for o in r["outputs"])


def test_a_line_is_read_parsed_and_checked_once(model, tmp_path, monkeypatch):
    """The path of a line: the file opened and read once, each line parsed once, each runnable line
    prepared (tokenized and checked against the model and the pool) once, and nothing checked again."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    from pagedinfer.core.limits import RequestLimits
    from pagedinfer.engine import intake
    from pagedinfer.lines import parse, source
    from pagedinfer.logits.processor import LogitsPipeline
    from pagedinfer.model import tokenizer_snapshot

    calls: dict[str, int] = {}

    def count(owner, name):
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    for owner, name in [
        (source.InputLines, "__init__"),
        (parse.LineParser, "parse"),
        (intake.Intake, "prepare"),
        (PreTrainedTokenizerBase, "__call__"),  # transformers' tokenizer, or its snapshot: either counts
        (tokenizer_snapshot.Tokenizer, "__call__"),
        (LogitsPipeline, "validate"),
        (RequestLimits, "rejection_reason"),
    ]:
        count(owner, name)
    read: list[int] = []
    real_iter = source.InputLines.__iter__
    monkeypatch.setattr(
        source.InputLines, "__iter__", lambda self: (read.append(n) or (n, t) for n, t in real_iter(self))
    )
    lines = [
        {"prompt": "hello", "max_tokens": 2, "logit_bias": {"5": 0.5}},
        {"prompt": 5},
        {"prompt_token_ids": [3, 4], "max_tokens": 2},
    ]
    path = write_jsonl(tmp_path / "once.jsonl", lines)
    assert run(model, path).exit_code == 1
    assert read == [1, 2, 3]  # every line read once, in order
    assert calls == {
        "__init__": 1,  # the input opened once
        "parse": 3,
        "prepare": 2,  # the two lines that can run: tokenized and checked once each
        "__call__": 1,  # the text prompt tokenized once
        "validate": 1,  # the one line whose logits a processor shapes
        "rejection_reason": 2,
    }


@pytest.mark.parametrize("width", [60, 80])
def test_the_summary_and_errors_fit_the_terminal_between_words(model, tmp_path, width):
    """On a terminal of ``width`` columns every line of the summary and of an error fits (wrapped
    between words, continuations indented), a path is never broken (one longer than the width stands
    whole on its own line) and the words are those of the unwrapped line; off a terminal, lines stay
    whole."""
    from rich.cells import cell_len

    folder = tmp_path / "a-folder-name-long-enough-to-push-the-output-path-past-sixty-columns"
    folder.mkdir()
    out = folder / "out.jsonl"
    src = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "To be", "max_tokens": 3}, {"prompt": "x", "logit_bias": {"100000": 1}}],
    )
    args = ["run", src, "--model", model, "-o", out, "--quiet"]
    # a terminal to Rich (TTY_COMPATIBLE), colourless (TERM=dumb: its size is then COLUMNS x LINES)
    terminal = {"COLUMNS": str(width), "LINES": "25", "TTY_COMPATIBLE": "1", "TERM": "dumb"}
    result = CliRunner(env=terminal).invoke(app, [str(a) for a in args])
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    assert all(cell_len(ln) <= width or ln.strip() == f"{out}:" for ln in lines), lines
    assert f"  {out}:" in lines  # the path on a line of its own: it is longer than the width
    assert all(ln.startswith("  ") for ln in lines[1:])  # continuations and the error line, indented
    said = " ".join(result.stdout.split())
    assert re.fullmatch(
        rf"pagedinfer: 2 lines → {re.escape(str(out))}: 1 ok, 1 failed \(line 2\) · 3 tokens generated in "
        r"[\d.]+ s ✗ line 2: logit_bias names token 100000, outside the model's vocabulary of 320 tokens",
        said,
    ), said
    missing = folder / "missing-input-file.jsonl"
    result = CliRunner(env=terminal).invoke(app, ["run", str(missing), "--model", model])
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines == ["error: input file", f"  {missing}", "  does not exist"], lines
    result = CliRunner(env={"COLUMNS": str(width)}).invoke(app, ["run", str(missing), "--model", model])
    assert result.stderr.splitlines() == [f"error: input file {missing} does not exist"]  # a log: whole

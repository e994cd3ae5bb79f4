"""Batch jobs that lose nothing: lines on disk at once, stop signals, per-request isolation, the lock,
disk full, flat memory (issue 12). Subprocess tests run ``python -m pagedinfer`` from this checkout."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import one_line_error, read_jsonl, sigterm, tiny_model, tiny_model_no_tokenizer, write_jsonl
from typer.testing import CliRunner

from pagedinfer.cli.app import app
from pagedinfer.cli.jsonl_output import OutputFile

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model())


def run(model: str, path: Path, *args) -> object:
    result = CliRunner().invoke(
        app, ["run", str(path), "--model", model, "--device", "cpu", "-q", *map(str, args)]
    )
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def _job(slow_tokens: int, fast: int) -> list[dict]:
    """Line 1 generates ``slow_tokens`` tokens; the ``fast`` lines after it finish in one step."""
    lines = [{"id": "slow", "prompt_token_ids": [3, 4], "max_tokens": slow_tokens, "ignore_eos": True}]
    lines += [
        {"id": f"f{i}", "prompt_token_ids": [5, 6 + i], "max_tokens": 2, "ignore_eos": True}
        for i in range(fast)
    ]
    return lines


def _start(path: Path, out: Path, model: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pagedinfer", "run", str(path), "--model", model, "-o", str(out), "-q"]
    cmd += ["--device", "cpu", "--no-report", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_lines(out: Path, count: int, proc: subprocess.Popen, limit: float = 300) -> None:
    start = time.monotonic()
    while not (out.exists() and out.read_bytes().count(b"\n") >= count):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - start < limit, "no lines written"
        time.sleep(0.01)


def test_sigkill_keeps_every_finished_line(model, tmp_path):
    path = write_jsonl(tmp_path / "k.jsonl", _job(slow_tokens=120, fast=6))
    out = tmp_path / "k.out.jsonl"
    proc = _start(path, out, model)
    _wait_for_lines(out, 6, proc)
    proc.kill()  # SIGKILL: no handler runs
    proc.wait()
    records = read_jsonl(out)  # every line on disk is a whole record
    assert sorted(r["id"] for r in records) == [f"f{i}" for i in range(6)]  # finished ahead of line 1: kept
    assert all(r["error"] is None and len(r["outputs"][0]["token_ids"]) == 2 for r in records)


def test_sigterm_finishes_the_step_and_resume_equals_an_uninterrupted_run(model, tmp_path):
    lines = _job(slow_tokens=120, fast=6)
    lines += [
        {"id": f"t{i}", "prompt_token_ids": [7, 8, i + 9], "max_tokens": 30} for i in range(4)
    ]  # sampled
    path = write_jsonl(tmp_path / "t.jsonl", lines)
    out = tmp_path / "t.out.jsonl"
    proc = _start(path, out, model)
    _wait_for_lines(out, 6, proc)
    kept, summary, _ = sigterm(proc, out)
    assert "run again with --resume" in summary
    assert "slow" not in {r["id"] for r in kept}

    assert run(model, path, "--resume").exit_code == 0
    reference = tmp_path / "reference.jsonl"
    assert run(model, path, "-o", reference).exit_code == 0
    assert out.read_bytes() == reference.read_bytes()  # same records, in input order
    assert [r["id"] for r in read_jsonl(out)] == [line["id"] for line in lines]


def test_sigkill_then_resume_with_adapters_and_structured_outputs_equals_an_uninterrupted_run(
    model, model_root, tmp_path
):
    """Lines with LoRA adapters (two, one slot: swapped) and structured outputs (regex, JSON schema,
    an OpenAI body's response_format), sampled and greedy: kill -9 mid-run, --resume, and the file is
    byte-identical to an uninterrupted run's (but for the OpenAI bodies' wall-clock ``created``)."""
    from models import save_lora

    root = model_root / "kill-loras"
    adapters = ("--lora", f"a={save_lora(Path(model), root, 'a', 8, seed=21)}")
    adapters += ("--lora", f"b={save_lora(Path(model), root, 'b', 4, seed=22)}", "--max-loras", "1")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    lines = _job(slow_tokens=120, fast=0)
    for i in range(12):
        line = {"id": f"s{i}", "prompt": f"To be {i}", "lora": "ab"[i % 2], "max_tokens": 12, "seed": i}
        shape = {"regex": "[a-z]{2,6}!"} if i % 3 else {"json": schema}
        lines.append(
            {**line, "structured_outputs": shape, **({"n": 2} if i % 4 == 1 else {"temperature": 0})}
        )
    for i in range(4):
        body = {
            "model": "ab"[i % 2],
            "messages": [{"role": "user", "content": f"Give n {i}"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
            "max_tokens": 16,
            "seed": 10 + i,
        }
        lines.append({"custom_id": f"o{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    path = write_jsonl(tmp_path / "k.jsonl", lines)
    out = tmp_path / "k.out.jsonl"
    proc = _start(path, out, model, *adapters)
    _wait_for_lines(out, 4, proc)
    proc.kill()  # SIGKILL: no handler runs
    proc.wait()
    assert 4 <= len(read_jsonl(out)) < len(lines)  # the slow line is still running

    assert run(model, path, "-o", out, "--resume", *adapters).exit_code == 0
    reference = tmp_path / "reference.jsonl"
    assert run(model, path, "-o", reference, *adapters).exit_code == 0
    created = re.compile(rb'"created": \d+')  # an OpenAI body's creation time (OpenAI's field): the clock's
    assert created.sub(b"", out.read_bytes()) == created.sub(b"", reference.read_bytes())
    records = read_jsonl(out)
    assert [r.get("custom_id", r["id"]) for r in records] == [x.get("id") or x["custom_id"] for x in lines]
    assert all(r.get("error") is None for r in records)


def test_sigterm_counts_the_lines_not_read_yet_as_not_run(model, tmp_path):
    lines = _job(slow_tokens=120, fast=6)
    lines += [{"id": f"u{i}", "prompt_token_ids": [7, i + 9], "max_tokens": 2} for i in range(40)]
    path = write_jsonl(tmp_path / "u.jsonl", lines)
    out = tmp_path / "u.out.jsonl"
    proc = _start(path, out, model, "--max-num-seqs", "2")  # reads 4 lines ahead of the engine
    _wait_for_lines(out, 6, proc)
    kept, summary, _ = sigterm(proc, out)
    assert f"{len(lines)} lines → {out}" in summary
    assert f"{len(lines) - len(kept)} lines not run" in summary, summary


def test_sigterm_counts_the_line_it_interrupts_with_the_tokens_the_progress_log_last_showed(model, tmp_path):
    """--max-num-seqs 1 (a window of 2 lines): three short lines, then a long one that the signal
    interrupts, one waiting in the engine and one not read. The log's last record, printed after the
    step the signal ended, names the long line and its tokens; the summary counts exactly those."""
    lines = [
        {"id": f"f{i}", "prompt_token_ids": [5, 6 + i], "max_tokens": 2, "ignore_eos": True} for i in range(3)
    ]
    lines += [{"id": "slow", "prompt_token_ids": [3, 4], "max_tokens": 120, "ignore_eos": True}]
    lines += [{"id": f"w{i}", "prompt_token_ids": [7, 8 + i], "max_tokens": 2} for i in range(2)]
    path = write_jsonl(tmp_path / "v.jsonl", lines)
    out = tmp_path / "v.out.jsonl"
    proc = _start(path, out, model, "--max-num-seqs", "1", "--progress", "log", "--progress-interval", "1e-6")
    _wait_for_lines(out, 3, proc)
    kept, summary, stderr = sigterm(proc, out)
    assert sorted(r["id"] for r in kept) == ["f0", "f1", "f2"]
    last = [ln for ln in stderr.splitlines() if ln.startswith("pagedinfer: progress")][-1]
    tokens = int(
        re.fullmatch(r".* done=3/5\+ read=\d+% .* running=1 longest=slow longest_tokens=(\d+)", last).group(1)
    )
    assert 0 < tokens < 120
    s = "s" if tokens != 1 else ""
    assert (
        f"3 lines not run: 1 interrupted mid-generation ({tokens:,} token{s} generated, all kept for --resume), 2 not started; "
        "run again with --resume" in summary
    ), summary


def test_values_that_would_crash_the_sampler_fail_their_line_alone(model, tmp_path):
    chat = "/v1/chat/completions"
    lines = [
        {"id": "ok", "prompt_token_ids": [3, 4], "max_tokens": 2},
        {"prompt_token_ids": [3], "logprobs": 5000},
        {
            "custom_id": "c",
            "method": "POST",
            "url": chat,
            "body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 4097},
        },
        {"prompt_token_ids": [3], "seed": 2**127},
        '{"prompt": "a\\ud800b"}',
        '{"messages": [{"role": "user", "content": "\\udfff"}]}',
        {"prompt_token_ids": [3], "temperature": 1e-40},
        '{"prompt_token_ids": [3], "temperature": Infinity}',
        {"prompt_token_ids": [3], "max_tokens": 2.5},
        {"prompt_token_ids": [3], "top_k": True},
        {"id": "huge", "prompt": "x" * 300_000},
        {"prompt_token_ids": [3], "logprobs": 321},  # the tiny model's vocabulary is 320
        {"id": "ok2", "prompt": "To be", "max_tokens": 2, "logprobs": 320},
    ]
    path = write_jsonl(tmp_path / "v.jsonl", lines)
    result = run(model, path, "--max-logprobs", "-1")  # unbounded: the vocabulary is the limit left
    assert result.exit_code == 1, result.output
    records = read_jsonl(tmp_path / "v.out.jsonl")
    assert len(records) == len(lines)
    assert records[0]["error"] is None and records[-1]["error"] is None
    assert len(records[-1]["outputs"][0]["logprobs"][0]["top_logprobs"]) == 320
    expected = {
        2: "logprobs=5000 exceeds the model's vocabulary of 320 tokens",
        3: "body.top_logprobs must be an integer from 0 to 20, not a number (4097)",
        4: "seed must be an integer from -2**63 to 2**64 - 1",
        5: "prompt is not valid Unicode (lone surrogate \\ud800 at character 1)",
        6: "messages[0].content is not valid Unicode (lone surrogate \\udfff",
        7: "temperature must be 0 (greedy) or at least 0.01",
        8: "not valid JSON (Infinity is not a JSON number)",
        9: "max_tokens must be an integer or null, not a number (2.5)",
        10: "top_k must be an integer, not a boolean",
        11: "the prompt has 300,000 characters: more than the model's context of 128 tokens can hold",
        12: "logprobs=321 exceeds the model's vocabulary of 320 tokens",
    }
    for line, reason in expected.items():
        record = records[line - 1]
        message = record["error"]["message"] if line == 3 else record["error"]
        assert message.startswith(f"line {line}: ") and reason in message, (line, message)
    assert len(json.dumps(records[10])) < 1500  # the error record echoes a bounded prefix of the prompt
    assert records[10]["prompt"].endswith("… (299,000 more characters)")


def test_python_api_validates_and_isolates_requests(model):
    from pagedinfer import LLM, SamplingParams
    from pagedinfer.sampling_params import MAX_SEED

    bad = [
        ({"temperature": 1e-40}, "at least 0.01"),
        ({"temperature": math.inf}, "finite number"),
        ({"top_p": math.nan}, "finite number"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer"),
        ({"top_k": True}, "top_k must be an integer"),
        ({"n": True}, "n must be an integer"),
        ({"seed": MAX_SEED + 1}, "seed must be an integer from"),
        ({"seed": 1.0}, "seed must be an integer"),
        ({"stop": ["\ud800"]}, "stop string is not valid Unicode"),
        ({"stop_token_ids": [-1]}, "non-negative"),
        ({"ignore_eos": 1}, "ignore_eos must be true or false"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    SamplingParams(temperature=0.01, seed=MAX_SEED, top_k=-1)  # the documented bounds themselves are fine

    llm = LLM(model, device="cpu", num_blocks=64, max_logprobs=-1)  # the vocabulary is the limit left
    outs = llm.generate(
        [{"prompt_token_ids": [3, 4]}, {"prompt_token_ids": [3, 4]}, "a\ud800", {"prompt_token_ids": [5]}],
        [
            SamplingParams(max_tokens=2, logprobs=321),
            SamplingParams(max_tokens=2, stop_token_ids=[320]),
            SamplingParams(max_tokens=2),
            SamplingParams(max_tokens=2, logprobs=320, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert "exceeds the model's vocabulary of 320" in outs[0].error
    assert "stop_token_ids must be below" in outs[1].error
    assert "not valid Unicode" in outs[2].error
    assert outs[3].error is None and len(outs[3].outputs[0].token_ids) == 2


def test_the_engine_holds_a_bounded_window_of_a_lazy_feed(model):
    from pagedinfer import LLM, SamplingParams

    llm = LLM(model, device="cpu", num_blocks=64, max_num_seqs=4)
    read = []

    def prompts():
        for i in range(16):
            read.append(i)
            yield {"prompt_token_ids": [3 + i % 7, 4]}, SamplingParams(max_tokens=3, seed=i), str(i)

    seen = []

    def on_step(engine) -> None:
        held = len(engine.scheduler.waiting) + len(engine.scheduler.running)
        seen.append((held, len(read)))

    outs = dict(llm.stream(prompts(), on_step=on_step, max_pending=6))
    assert max(held for held, _ in seen) <= 6
    assert seen[0][1] == 6  # the feed is read only as the window has room
    assert sorted(outs) == list(range(16))
    whole = llm.generate(
        [{"prompt_token_ids": [3 + i % 7, 4]} for i in range(16)],
        [SamplingParams(max_tokens=3, seed=i) for i in range(16)],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in whole] == [outs[i].outputs[0].token_ids for i in range(16)]


def test_a_second_run_on_a_locked_output_is_refused(model, tmp_path):
    path = write_jsonl(tmp_path / "l.jsonl", [{"prompt_token_ids": [3], "max_tokens": 1}])
    out = tmp_path / "l.out.jsonl"
    out.write_text('{"id": "from the first run"}\n')
    first = OutputFile(out)  # another run holds the lock (flock conflicts across open files)
    try:
        result = run(model, path)
        assert result.exit_code == 2
        assert "output file" in result.stderr and "is locked by another pagedinfer run" in result.stderr
        assert out.read_text() == '{"id": "from the first run"}\n'  # nothing truncated
    finally:
        first.close()
    assert run(model, path).exit_code == 0


@pytest.mark.parametrize("link", ["hard", "symbolic"])
def test_an_output_that_is_the_input_through_a_link_is_refused(model, tmp_path, link):
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt_token_ids": [3], "max_tokens": 1}])
    alias = tmp_path / "alias.jsonl"
    (os.link if link == "hard" else os.symlink)(path, alias)
    before = path.read_bytes()
    result = run(model, path, "-o", alias)
    assert result.exit_code == 2 and "is the input file" in result.stderr
    assert path.read_bytes() == before


@contextlib.contextmanager
def _small_disk(where: Path, monkeypatch):
    """A 64 KiB tmpfs at ``where`` when this process may mount one (root), else a simulated ENOSPC
    once 64 KiB went to files under ``where``. Yields True for the real mount."""
    where.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True
        ).returncode
        == 0
    )
    if not mounted:
        real_write, budget = os.write, [64 * 1024]

        def write(fd, data):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(where)):
                if len(data) > budget[0]:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                budget[0] -= len(data)
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", write)
    try:
        yield mounted
    finally:
        monkeypatch.undo()
        if mounted:
            subprocess.run(["umount", str(where)], check=True)


def test_disk_full_keeps_the_lines_written_and_resume_completes(model, tmp_path, monkeypatch):
    lines = [{"id": i, "prompt_token_ids": [3, i + 4], "max_tokens": 4, "logprobs": 20} for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    reference = tmp_path / "reference.jsonl"
    assert run(model, path, "-o", reference).exit_code == 0
    assert reference.stat().st_size > 128 * 1024  # twice what the small disk holds

    small = tmp_path / "small"
    with _small_disk(small, monkeypatch):
        result = run(model, path, "-o", small / "d.out.jsonl")
        partial = (small / "d.out.jsonl").read_bytes()
    assert result.exit_code == 74, result.output
    message = " ".join(result.stderr.split())
    kept = [json.loads(x) for x in partial.splitlines()]  # whole records only, no torn line
    assert 0 < len(kept) < len(lines)
    assert "No space left on device" in message and f"{len(kept)} lines on disk in" in message
    assert "run again with --resume" in message and "Traceback" not in result.output

    out = tmp_path / "d.out.jsonl"  # space is back
    out.write_bytes(partial)
    assert run(model, path, "-o", out, "--resume").exit_code == 0
    assert out.read_bytes() == reference.read_bytes()


def test_resume_drops_unreadable_middle_lines_and_reruns_them(model, tmp_path):
    lines = [{"id": i, "prompt_token_ids": [3, i + 4], "max_tokens": 3} for i in range(5)]
    path = write_jsonl(tmp_path / "r.jsonl", lines)
    out = tmp_path / "r.out.jsonl"
    assert run(model, path).exit_code == 0
    complete = out.read_bytes()
    records = complete.splitlines(keepends=True)
    out.write_bytes(
        records[3] + records[0] + b"\x00\x17garbage\n" + records[4]
    )  # any order, one corrupt line
    result = run(model, path, "--resume")
    assert result.exit_code == 0
    assert "dropped 1 unreadable line" in result.stderr
    assert out.read_bytes() == complete


def _interrupted_job(model: str, tmp_path: Path, *args: str) -> tuple[Path, Path, bytes]:
    """A completed run of five seeded lines, then its output cut to two records as if it had been killed:
    (input, output, the complete output)."""
    lines = [{"id": i, "prompt_token_ids": [3, i + 4]} for i in range(5)]  # the defaults decide
    path = write_jsonl(tmp_path / "o.jsonl", lines)
    out = tmp_path / "o.out.jsonl"
    assert run(model, path, *args).exit_code == 0
    complete = out.read_bytes()
    out.write_bytes(b"".join(complete.splitlines(keepends=True)[:2]))
    return path, out, complete


@pytest.mark.parametrize(
    ("first", "then", "words"),
    [
        ((), ("--temperature", "0.5"), "--temperature 1.0; this run has --temperature 0.5"),
        (
            ("--max-tokens", "3"),
            ("--seed", "1", "--max-tokens", "4"),
            "--seed 0 --max-tokens 3; this run has --seed 1 --max-tokens 4",
        ),
        (("--max-tokens", "3"), (), "--max-tokens 3; this run has --max-tokens (default)"),
    ],
)
def test_resume_refuses_other_options_and_leaves_the_output_untouched(model, tmp_path, first, then, words):
    path, out, _ = _interrupted_job(model, tmp_path, *first)
    partial, sidecar = out.read_bytes(), (tmp_path / "o.out.jsonl.resume").read_bytes()
    result = run(model, path, "--resume", *then)
    one_line_error(
        result,
        f"error: --resume: {out} was written with {words}: give the same options, "
        "or run without --resume to start over",
    )
    assert out.read_bytes() == partial and (tmp_path / "o.out.jsonl.resume").read_bytes() == sidecar


def test_resume_may_change_speed_settings_and_keeps_the_options(model, tmp_path):
    path, out, complete = _interrupted_job(model, tmp_path, "--resume")  # a script that always resumes
    result = run(model, path, "--resume", "--max-num-seqs", "1", "--no-prefix-caching", "--block-size", "8")
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == complete
    out.write_bytes(b"".join(complete.splitlines(keepends=True)[:3]))
    result = run(model, path, "--resume", "--seed", "2")  # the first run's options are still kept
    one_line_error(result, f"--resume: {out} was written with --seed 0; this run has --seed 2")


def test_an_older_resume_file_without_options_still_resumes(model, tmp_path):
    path, out, complete = _interrupted_job(model, tmp_path)
    sidecar = tmp_path / "o.out.jsonl.resume"
    sidecar.write_bytes(sidecar.read_bytes()[:512])  # the fingerprint alone, as older versions keep it
    result = run(model, path, "--resume", "--seed", "3")
    assert result.exit_code == 0, result.output
    assert (
        "o.out.jsonl.resume keeps no options (an older version wrote it), so they cannot be checked"
        in " ".join(result.stderr.split())
    )
    records = out.read_bytes().splitlines(keepends=True)
    assert len(records) == 5 and records[:2] == complete.splitlines(keepends=True)[:2]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_batch_memory", ROOT / "scripts" / "bench_batch_memory.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def test_memory_stays_flat_from_20k_to_200k_lines(tmp_path):
    """Peak RSS of the whole command grows < 100 MB (about 500 bytes a line) from 20k to 200k lines.

    Every line is streamed, validated, checked against the model, written and put in order; only
    every 10,000th can run (the others use a token id beyond the vocabulary), so the engine stays
    cheap; `test_the_engine_holds_a_bounded_window_of_a_lazy_feed` bounds what generation holds.
    """
    bench = _bench()
    model = str(tiny_model_no_tokenizer())
    peaks = {}
    for lines in (20_000, 200_000):
        prompts = bench.write_input(tmp_path / f"in{lines}.jsonl", lines, runnable_every=10_000)
        out = tmp_path / f"out{lines}.jsonl"
        m = bench.measure(prompts, out, ["--model", model, "--device", "cpu"], timeout=600)
        assert m.exit_code == 1 and out.read_bytes().count(b"\n") == lines
        peaks[lines] = m.peak_rss_mb
    ok = read_jsonl(tmp_path / "out200000.jsonl")[::10_000]
    assert all(r["error"] is None for r in ok)  # the runnable lines ran, and the file is in input order
    assert peaks[200_000] - peaks[20_000] < 100, peaks

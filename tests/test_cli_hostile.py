"""Batch jobs that lose nothing, part two (issue 27): input tried as a hostile user would.

Duplicate keys, pipes, colliding and linked paths, hostile numbers, changed inputs, device and pipe
outputs, pools that cannot be allocated, bounded chat templates, unreachable Ray clusters; and a
randomized crash test: a seeded job killed at random moments and resumed each time ends byte for
byte as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_helpers import CHAT_TEMPLATE, invoke, one_line_error, read_jsonl, tiny_model, write_jsonl

from pagedinfer import chat_render
from pagedinfer.engine import intake

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model())


def run(model: str | None, path: Path | str, *args) -> object:
    return invoke("run", path, "-q", "--device", "cpu", *args, *(["--model", model] if model else []))


def line(i: int, **extra) -> dict:
    return {"id": f"l{i}", "prompt_token_ids": [3, 4 + i % 50], "max_tokens": 3, **extra}


# -- keys ---------------------------------------------------------------------------------------------
def test_a_repeated_id_is_an_error_in_its_own_place_and_never_marks_the_first_done(model, tmp_path):
    lines = [line(0), {"id": "l0", "prompt": "again"}, line(2)]
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    out = tmp_path / "d.out.jsonl"
    assert run(model, path).exit_code == 1
    first, dup, last = read_jsonl(out)
    assert first["id"] == "l0" and first["error"] is None and last["id"] == "l2"
    assert dup == {
        "id": 2,
        "line": 2,
        "prompt": "again",
        "error": "line 2: duplicate id 'l0' (first used on line 1)",
    }
    complete = out.read_bytes()
    # a crash right after the duplicate's error record (it is written first: no model needed for it)
    out.write_text(json.dumps(dup) + "\n")
    result = run(model, path, "--resume")
    assert result.exit_code == 1 and "1 already done" in " ".join(result.stdout.split())
    assert out.read_bytes() == complete  # line 1 ran: the duplicate did not stand for it


def test_a_repeated_custom_id_is_answered_by_its_line(model, tmp_path):
    body = {"prompt_token_ids": [3, 4], "max_tokens": 2}
    lines = [
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": [3, 4], "max_tokens": 2},
        },
        {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": 3}},
        "{torn",
    ]
    path = write_jsonl(tmp_path / "o.jsonl", lines)
    assert run(model, path).exit_code == 1
    first, dup, torn = read_jsonl(tmp_path / "o.out.jsonl")
    assert first["custom_id"] == "a" and first["response"]["status_code"] == 200 and body
    assert dup == {
        "id": "line-2",
        "custom_id": None,
        "line": 2,
        "response": None,
        "error": {
            "code": "invalid_request",
            "message": "line 2: duplicate custom_id 'a' (first used on line 1)",
        },
    }
    assert torn["custom_id"] is None and torn["line"] == 3 and "not valid JSON" in torn["error"]["message"]


# -- the input ----------------------------------------------------------------------------------------
def test_an_input_from_a_pipe_is_read_once(model, tmp_path):
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    text = "".join(json.dumps(line(i)) + "\n" for i in range(3))
    writer = threading.Thread(target=lambda: fifo.write_text(text), daemon=True)
    writer.start()
    out = tmp_path / "o.jsonl"
    result = run(model, fifo, "-o", out, "--strict")  # --strict reads it three times: from the spool
    writer.join(timeout=60)
    assert result.exit_code == 0, result.output
    assert "3 lines" in result.stdout and "3 ok" in result.stdout
    assert [r["id"] for r in read_jsonl(out)] == ["l0", "l1", "l2"]


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("9" * 5000, "not valid JSON: exceeds the limit (4300 digits) for integer string conversion"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON: nested more than 64 levels deep"),
        ("[" * 70 + "]" * 70, "nested more than 64 levels deep"),
        ("9" * 400 + ".5", "not valid JSON (the number 99999999999999999999… is out of range)"),
        ("1e999", "not valid JSON (the number 1e999 is out of range)"),
        ("NaN", "not valid JSON (NaN is not a JSON number)"),
        ("9" * 400, "n must be below 2**63, not an integer of 400 digits"),
    ],
    ids=["4300-digits", "deep", "65-deep", "400-digit-float", "1e999", "nan", "400-digit-int"],
)
def test_hostile_values_fail_their_line_and_resume_finishes(model, tmp_path, value, reason):
    field = "n" if value == "9" * 400 else "seed"
    text = (
        json.dumps(line(0)) + "\n" + f'{{"prompt": "x", "{field}": {value}}}\n' + json.dumps(line(2)) + "\n"
    )
    path = tmp_path / "h.jsonl"
    path.write_text(text)
    result = run(model, path)
    assert result.exit_code == 1 and "Traceback" not in result.output
    records = read_jsonl(tmp_path / "h.out.jsonl")
    assert records[1]["error"] == f"line 2: {reason}" and records[1]["line"] == 2
    assert records[0]["error"] is None and records[2]["error"] is None
    assert run(model, path, "--resume").exit_code == 1  # nothing left to run; the error stays


def test_a_json_error_at_the_end_of_a_line_says_so(model, tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", ['{"prompt": "x"', '{"prompt": "x",, "n": 1}'])
    assert run(model, path).exit_code == 1
    a, b = read_jsonl(tmp_path / "e.out.jsonl")
    assert a["error"] == "line 1: not valid JSON (Expecting ',' delimiter at the end of the line)"
    assert (
        b["error"]
        == "line 2: not valid JSON (Expecting property name enclosed in double quotes at character 16 of 24)"
    )


def test_resume_refuses_an_input_that_changed(model, tmp_path):
    lines = [{"prompt_token_ids": [3, 4 + i], "max_tokens": 2} for i in range(4)]  # no ids: keyed by line
    path = write_jsonl(tmp_path / "c.jsonl", lines)
    out = tmp_path / "c.out.jsonl"
    assert run(model, path).exit_code == 0
    assert (tmp_path / "c.out.jsonl.resume").exists()
    complete = out.read_bytes()
    out.write_bytes(b"".join(complete.splitlines(keepends=True)[:2]))  # as if killed after two lines
    assert run(model, path, "--resume").exit_code == 0 and out.read_bytes() == complete  # unchanged input
    out.write_bytes(b"".join(complete.splitlines(keepends=True)[:2]))
    write_jsonl(path, [{"prompt_token_ids": [9, 9], "max_tokens": 2}, *lines])  # a line inserted on top
    result = run(model, path, "--resume")
    one_line_error(result, f"--resume: input file {path} changed since {out} was written")
    assert "its first 4 lines differ from the ones the earlier run answered" in " ".join(
        result.stderr.split()
    )
    assert out.read_bytes() == b"".join(complete.splitlines(keepends=True)[:2])  # untouched


# -- output paths -------------------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["--report-json", "--trace"])
def test_a_report_or_trace_on_the_output_is_refused(model, tmp_path, option):
    path = write_jsonl(tmp_path / "p.jsonl", [line(0)])
    out = tmp_path / "p.out.jsonl"
    out.write_text('{"id": "kept"}\n')
    result = run(model, path, option, out)
    one_line_error(result, f"{option} file {out} is the same file as the output file")
    assert out.read_text() == '{"id": "kept"}\n'


def test_an_output_symlink_is_written_through_and_kept(model, tmp_path):
    lines = [{"id": "slow", "prompt_token_ids": [3, 4], "max_tokens": 12, "ignore_eos": True}]
    lines += [line(i, max_tokens=1) for i in range(1, 4)]  # finish first: the file needs its reorder
    path = write_jsonl(tmp_path / "s.jsonl", lines)
    target = tmp_path / "real" / "out.jsonl"
    target.parent.mkdir()
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    assert run(model, path, "-o", link).exit_code == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert [r["id"] for r in read_jsonl(target)] == ["slow", "l1", "l2", "l3"]  # the target, in input order


def test_a_link_planted_at_a_temporary_name_is_never_followed(model, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("another user's file\n")
    lines = [{"id": "slow", "prompt_token_ids": [3, 4], "max_tokens": 12, "ignore_eos": True}]
    lines += [line(i, max_tokens=1) for i in range(1, 4)]
    path = write_jsonl(tmp_path / "t.jsonl", lines)
    for name in ("t.out.jsonl.tmp", ".t.out.jsonl.tmp", ".t.out.jsonl.x.tmp"):
        (tmp_path / name).symlink_to(victim)
    assert run(model, path).exit_code == 0
    assert victim.read_text() == "another user's file\n"
    assert [r["id"] for r in read_jsonl(tmp_path / "t.out.jsonl")] == ["slow", "l1", "l2", "l3"]
    assert (tmp_path / ".t.out.jsonl.x.tmp").is_symlink()  # not ours: left alone
    assert sorted(p.name for p in tmp_path.glob(".t.out.jsonl.*.tmp")) == [".t.out.jsonl.x.tmp"]


def test_device_and_fifo_outputs(model, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [line(i) for i in range(3)])
    assert run(model, path, "-o", "/dev/null").exit_code == 0
    full = run(model, path, "-o", "/dev/full")
    assert (
        full.exit_code == 74 and "No space left on device" in full.stderr and "Traceback" not in full.output
    )
    said = " ".join(full.output.split())
    assert (
        ": 0 ok" in said and "0 lines written to /dev/full, 3 lines not run" in said
    )  # no write: no line is ok
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    one_line_error(run(model, path, "-o", fifo), f"cannot write output {fifo}: no process is reading it")
    got: list[bytes] = []
    opened = threading.Event()

    def read() -> None:  # a reader that is there before the run opens the FIFO, until the run closes it
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        opened.set()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            select.select([fd], [], [], 0.1)
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if data:
                got.append(data)
            elif got:  # end of file after the data: the run closed its end
                break
            else:  # no writer yet
                time.sleep(0.05)
        os.close(fd)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    opened.wait(10)
    assert run(model, path, "-o", fifo).exit_code == 0
    reader.join(60)
    assert [json.loads(x)["id"] for x in b"".join(got).splitlines()] == ["l0", "l1", "l2"]  # input order
    one_line_error(
        run(model, path, "-o", "/dev/null", "--resume"), "--resume needs an output file, not /dev/null"
    )


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedinfer", *args]


def test_a_closed_pipe_stops_the_run_with_one_line(model, tmp_path):
    # about 6 KiB a record: the pipe's 64 KiB buffer holds a few, so the reader's exit is felt at once
    path = write_jsonl(tmp_path / "p.jsonl", [line(i, max_tokens=8, logprobs=20) for i in range(40)])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = " ".join(_cli("run", str(path), "--model", model, "-o", "-", "-q", "--device", "cpu"))
    proc = subprocess.run(
        ["bash", "-c", f"{command} 2>{tmp_path / 'err.txt'} | head -1; echo ${{PIPESTATUS[0]}}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    first, status = proc.stdout.splitlines()
    assert json.loads(first)["id"] == "l0" and status == "141"
    err = (tmp_path / "err.txt").read_text()
    assert (
        "stopped: the reader of the output closed it after" in " ".join(err.split())
        and "Traceback" not in err
    )


# -- pool and cluster ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--kv-cache-memory", "500TB"),
            "--kv-cache-memory=500,000,000,000,000 bytes needs 465,661.3 GiB of KV cache but only",
        ),
        (("--num-blocks", str(10**12)), "--num-blocks=1,000,000,000,000 needs"),
    ],
)
def test_a_pool_that_cannot_be_allocated_is_refused(model, tmp_path, args, message):
    path = write_jsonl(tmp_path / "p.jsonl", [line(0)])
    result = run(model, path, *args)
    one_line_error(result, message)
    assert "is free; give" in result.stderr


def test_an_unreachable_ray_address_fails_within_seconds(model, tmp_path):
    pytest.importorskip("ray", reason="Ray is a test dependency")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    path = write_jsonl(tmp_path / "p.jsonl", [line(0)])
    start = time.monotonic()
    result = run(model, path, "--data-parallel", "2", "--ray-address", f"127.0.0.1:{port}")
    one_line_error(result, f"cannot reach the Ray cluster at 127.0.0.1:{port}: Connection refused")
    assert time.monotonic() - start < 30


# -- chat templates -----------------------------------------------------------------------------------
def _model_with_template(root: Path, template: str) -> Path:
    import shutil

    out = root / "templated"
    shutil.copytree(tiny_model(), out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


HUGE_LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + CHAT_TEMPLATE


def test_a_template_that_never_ends_fails_its_line_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(chat_render, "TEMPLATE_BUDGET_S", 0.5)
    templated = _model_with_template(
        tmp_path,
        "{% if messages[0].content == 'loop' %}" + HUGE_LOOP + "{% else %}" + CHAT_TEMPLATE + "{% endif %}",
    )
    lines = [{"messages": [{"role": "user", "content": c}], "max_tokens": 2} for c in ("hi", "loop", "bye")]
    path = write_jsonl(tmp_path / "c.jsonl", lines)
    start = time.monotonic()
    result = run(str(templated), path)
    assert result.exit_code == 1 and time.monotonic() - start < 60
    a, loop, b = read_jsonl(tmp_path / "c.out.jsonl")
    assert loop["error"] == "line 2: the chat template ran longer than 0.5 s for these messages"
    assert a["error"] is None and b["error"] is None


def test_a_template_that_allocates_without_bound_fails_each_chat_line_alone(tmp_path):
    """A constant expression of 10 GB (folded by Jinja as it compiles, so on every line) fails each
    chat line at the memory limit, at once; the other lines are byte-identical to a run without it."""
    hostile = "{% if messages[0].content == 'big' %}{{ 'a' * 10000000000 }}{% endif %}" + CHAT_TEMPLATE
    templated = _model_with_template(tmp_path, hostile)
    chat = [
        {"id": c, "messages": [{"role": "user", "content": c}], "max_tokens": 3} for c in ("hi", "big", "bye")
    ]
    path = write_jsonl(tmp_path / "c.jsonl", chat + [line(3)])
    start = time.monotonic()
    assert run(str(templated), path).exit_code == 1
    assert time.monotonic() - start < 60
    records = read_jsonl(tmp_path / "c.out.jsonl")
    assert (
        records[1]["error"]
        == "line 2: the chat template needs more than 1,024 MiB of memory for these messages"
    )
    alone = write_jsonl(tmp_path / "alone.jsonl", [chat[0], chat[2], line(3)])
    assert run(str(tiny_model()), alone).exit_code == 0
    expected = read_jsonl(tmp_path / "alone.out.jsonl")
    assert [json.dumps(r) for r in (records[0], records[2], records[3])] == [
        json.dumps({**r, "line": n}) for r, n in zip(expected, (1, 3, 4), strict=True)
    ]


def test_a_chat_template_that_cannot_compile_is_one_line_before_the_run(model, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages | nosuchfilter }}", encoding="utf-8")
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    result = run(model, path, "--chat-template", template)
    one_line_error(result, f"chat template {template} line 1: No filter named 'nosuchfilter'.")


def test_sigterm_during_a_render_ends_the_run_at_once(model, tmp_path, monkeypatch):
    """The first SIGTERM during generation lets the current step finish; a render in progress is
    abandoned at once (its line is not run: --resume runs it), not waited for to its budget."""
    monkeypatch.setattr(chat_render, "TEMPLATE_BUDGET_S", 120)
    templated = _model_with_template(
        tmp_path,
        "{% if messages[0].content == 'loop' %}" + HUGE_LOOP + "{% else %}" + CHAT_TEMPLATE + "{% endif %}",
    )
    real, renders = chat_render.render, []

    def render(*args, **kwargs):
        if args[1][0]["content"] == "loop":
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        start = time.monotonic()
        try:
            return real(*args, **kwargs)
        finally:
            renders.append(time.monotonic() - start)

    monkeypatch.setattr(chat_render, "render", render)
    lines = [{"messages": [{"role": "user", "content": c}], "max_tokens": 2} for c in ("hi", "loop", "bye")]
    path = write_jsonl(tmp_path / "c.jsonl", lines)
    result = run(str(templated), path)
    assert result.exit_code == 143, result.output
    assert len(renders) == 2 and renders[1] < 10  # the loop alone would run for the 120 s budget
    words = " ".join(result.output.split())
    assert "interrupted by SIGTERM: 0 lines on disk" in words and "3 lines not run" in words
    assert read_jsonl(tmp_path / "c.out.jsonl") == []  # the stopped line has no (error) record


def test_sigterm_during_a_long_template_is_honoured_at_once(tmp_path):
    templated = _model_with_template(tmp_path, HUGE_LOOP)
    lines = [{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}] * 3
    path = write_jsonl(tmp_path / "c.jsonl", lines)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        _cli("run", str(path), "--model", str(templated), "-q", "--device", "cpu"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(12)  # torch, the model, then the first line's template (a stop before it acts at once)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert time.monotonic() - start < chat_render.TEMPLATE_BUDGET_S + 10
    assert proc.returncode == 143, err
    words = " ".join((out + err).split())
    assert (
        "interrupted by SIGTERM" in words or "stopped by SIGTERM at once" in words
    ) and "Traceback" not in err


def test_a_stop_during_the_last_lines_intake_still_stops_the_run(model, tmp_path, monkeypatch):
    """A SIGTERM that arrives while the last line is prepared, when no engine step follows (every line
    refused at intake), is still the run's outcome: exit 143 and the interrupted report, as it is
    after a step (timed, this is what test_sigterm_during_a_long_template_... hits on a fast CPU)."""
    real = intake.Intake.prepare
    calls = []

    def prepare(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only records it: generation is under way
        return real(*args, **kwargs)

    monkeypatch.setattr(intake.Intake, "prepare", prepare)
    lines = [
        {"id": f"v{i}", "prompt_token_ids": [10**6], "max_tokens": 2} for i in range(2)
    ]  # past the vocab
    path = write_jsonl(tmp_path / "s.jsonl", lines)
    result = run(model, path)
    assert len(calls) == 2
    assert result.exit_code == 143, result.output
    assert "interrupted by SIGTERM" in " ".join(result.output.split())
    assert [r["id"] for r in read_jsonl(tmp_path / "s.out.jsonl")] == ["v0", "v1"]


# -- crashes ------------------------------------------------------------------------------------------
def _crash_job(tmp_path: Path) -> Path:
    rng = random.Random(27)
    lines: list = []
    for i in range(200):
        lines.append(
            {
                "id": f"q{i}",
                "prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randrange(2, 16))],
                "max_tokens": rng.randrange(1, 12),
                "n": 4,
                "temperature": 0.8,
            }
        )
        if i % 37 == 5:
            lines.append({"id": f"q{i - 3}", "prompt": "a duplicate"})
        if i % 41 == 7:
            lines.append('{"prompt": "torn')
    return write_jsonl(tmp_path / "crash.jsonl", lines)


def test_random_kills_and_resumes_end_as_an_uninterrupted_run(model, tmp_path):
    path = _crash_job(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    reference = tmp_path / "reference.jsonl"
    base = ["run", str(path), "--model", model, "-q", "--device", "cpu", "--seed", "5", "--no-report"]
    start = time.monotonic()
    subprocess.run(_cli(*base, "-o", str(reference)), env=env, check=False, capture_output=True, timeout=600)
    whole = time.monotonic() - start
    assert read_jsonl(reference)[-1]["id"] == "q199"
    out = tmp_path / "out.jsonl"
    rng = random.Random(2027)
    for attempt in range(10):
        args = [*base, "-o", str(out), *(["--resume"] if attempt else [])]
        proc = subprocess.Popen(_cli(*args), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(0.0, whole * 1.1))  # startup, --resume's checks, generation or the reorder
        proc.kill()
        proc.wait()
    final = subprocess.run(_cli(*base, "-o", str(out), "--resume"), env=env, capture_output=True, timeout=600)
    assert final.returncode == 1, final.stderr  # the duplicates and the torn lines
    assert out.read_bytes() == reference.read_bytes()
    assert not list(tmp_path.glob(".out.jsonl.*.tmp"))

"""What a run shows while it generates (`--progress`), and the per-run bounds on lines that never end
(`--max-line-tokens`, `--line-timeout`), on the tiny CLI model."""

from __future__ import annotations

import io
import json
import re
from types import SimpleNamespace

import pytest
from cli_helpers import invoke, one_line_error, read_jsonl, tiny_model, write_jsonl
from rich.console import Console

LOG = re.compile(
    r"pagedinfer: progress elapsed=\d+s done=(\d+)/(\d+\+?)(?: read=\d+%)? tok/s=\d+\.\d eta=(\?|\d+s) "
    r'kv=(\d+)/(\d+) running=(\d+)(?: longest=("(?:[^"\\]|\\.)*"|[^\s"]+) longest_tokens=(\d+))?'
)


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model())


def run(model: str, path, *args):
    return invoke("run", path, "--model", model, "--device", "cpu", "--no-report", *args)


def _records(stderr: str) -> list[tuple]:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("pagedinfer: progress")]
    found = [LOG.fullmatch(ln) for ln in lines]
    assert all(found), lines
    return [m.groups() for m in found]


def test_the_progress_log_off_a_terminal_has_one_record_per_interval_in_its_fixed_shape(model, tmp_path):
    """An interval shorter than a step: a record after every step, each naming the line running longest."""
    lines = [
        {"id": "slow", "prompt_token_ids": [3, 4], "max_tokens": 12, "ignore_eos": True},
        {"id": "fast line", "prompt_token_ids": [5, 6], "max_tokens": 2, "ignore_eos": True},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    result = run(model, path, "--progress-interval", "1e-9")
    assert result.exit_code == 0, result.output
    records = _records(result.stderr)
    # (done, total, kv used, running, longest, its tokens) after each of the 12 steps; the input is
    # read to its end before the first step (both lines fit the engine's window)
    got = [
        (done, total, used, running, longest, tokens)
        for done, total, _, used, _, running, longest, tokens in records
    ]
    assert got[0] == ("0", "2", "2", "2", "slow", "1")  # both started in step 1: input order
    assert got[1:11] == [("1", "2", "1", "1", "slow", str(k)) for k in range(2, 12)]
    assert got[11:] == [("2", "2", "0", "0", None, None)]
    assert records[0][2] == "?" and all(r[2] != "?" for r in records[1:])  # an ETA once a line is done


def test_the_log_quotes_an_id_with_a_space_and_counts_lines_read_until_the_input_ends(model, tmp_path):
    """A window of 2 lines (--max-num-seqs 1): the input is not read to its end while line 1 runs."""
    lines = [{"id": "a b", "prompt_token_ids": [3, 4], "max_tokens": 3, "ignore_eos": True}]
    lines += [{"prompt_token_ids": [5, 6 + i], "max_tokens": 1} for i in range(4)]
    path = write_jsonl(tmp_path / "q.jsonl", lines)
    result = run(model, path, "--progress", "log", "--progress-interval", "1e-9", "--max-num-seqs", "1")
    assert result.exit_code == 0, result.output
    first = [ln for ln in result.stderr.splitlines() if ln.startswith("pagedinfer: progress")][0]
    assert re.search(r' done=0/2\+ read=\d+% .* longest="a b" longest_tokens=1$', first), first
    assert _records(result.stderr)[-1][:2] == ("5", "5")


def test_no_progress_with_none_or_quiet_unless_chosen(model, tmp_path):
    path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": "x", "max_tokens": 6, "ignore_eos": True}])
    for args in (("--progress", "none"), ("-q",)):
        result = run(model, path, "--progress-interval", "1e-9", *args)
        assert result.exit_code == 0 and result.stderr == "", result.output
    result = run(model, path, "--progress-interval", "1e-9", "-q", "--progress", "log")  # the choice wins
    assert len(_records(result.stderr)) == 6


def test_the_bar_off_a_terminal_and_the_rate_of_generation_alone(model, tmp_path, monkeypatch):
    """``--progress bar`` into a file draws its last frame; its tok/s counts from the loaded model, so
    a load that takes 100 s does not show in it."""
    import time

    from pagedinfer.cli.run import RunOptions, execute
    from pagedinfer.llm import LLM

    path = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "x", "max_tokens": 8, "ignore_eos": True}])
    result = run(model, path, "--progress", "bar")
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("lines 1 100% read ") and " tok/s " in result.stderr, result.stderr

    late = [0.0]  # seconds the progress clock runs ahead of the real one
    original = LLM.__init__

    def slow_load(self, *args, **kwargs):  # the model loads in 100 s of the progress clock
        original(self, *args, **kwargs)
        late[0] += 100.0

    monkeypatch.setattr(LLM, "__init__", slow_load)
    monkeypatch.setattr(
        "pagedinfer.cli.progress.time", SimpleNamespace(perf_counter=lambda: time.perf_counter() + late[0])
    )
    err = Console(file=io.StringIO(), force_terminal=True, width=120)
    opts = RunOptions(prompts=path, model=model, engine={"device": "cpu"}, report=False)
    assert execute(opts, Console(file=io.StringIO()), err) == 0
    last = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", err.file.getvalue()).split("\r")[-1]
    rate = float(re.search(r"([\d,.]+) tok/s", last).group(1).replace(",", ""))
    assert rate > 8 / 100, last  # 8 tokens over the load's 100 s would read 0.08


def test_max_line_tokens_caps_every_shape_of_line_and_says_so(model, tmp_path):
    chat = [{"role": "user", "content": "To be?"}]
    lines = [
        {"id": "chat", "messages": chat, "ignore_eos": True},  # no max_tokens: the end of the context
        {"id": "own", "prompt": "To be", "max_tokens": 3, "ignore_eos": True},  # its own is lower
        {"id": "equal", "prompt": "To be", "max_tokens": 5, "ignore_eos": True},  # the cap changes nothing
        {"id": "beams", "prompt_token_ids": [3, 4], "beam_width": 2, "max_tokens": 40, "ignore_eos": True},
        {
            "custom_id": "openai",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": chat, "n": 2, "ignore_eos": True},
        },
    ]
    path = write_jsonl(tmp_path / "c.jsonl", lines)
    report = tmp_path / "c.json"
    result = run(model, path, "--max-line-tokens", "5", "--report-json", report, "-q")
    assert result.exit_code == 0, result.output
    chat_r, own, equal, beams, openai = read_jsonl(tmp_path / "c.out.jsonl")
    capped = {"finish_reason": "length", "capped_by": "max_line_tokens"}
    assert len(chat_r["outputs"][0]["token_ids"]) == 5
    assert {k: chat_r["outputs"][0][k] for k in capped} == capped
    assert len(own["outputs"][0]["token_ids"]) == 3 and "capped_by" not in own["outputs"][0]
    assert len(equal["outputs"][0]["token_ids"]) == 5 and "capped_by" not in equal["outputs"][0]
    assert [(len(b["token_ids"]), b["finish_reason"], b["capped_by"]) for b in beams["beams"]] == [
        (5, "length", "max_line_tokens")
    ] * 2
    choices = openai["response"]["body"]["choices"]
    assert [(c["finish_reason"], c["capped_by"]) for c in choices] == [("length", "max_line_tokens")] * 2
    assert openai["response"]["body"]["usage"]["completion_tokens"] == 10
    summary = " ".join(result.stdout.split())
    assert "5 lines → " in summary and ": 5 ok (3 capped by --max-line-tokens) · " in summary, summary
    doc = json.loads(report.read_text())["run"]
    assert (doc["capped_by_max_line_tokens"], doc["capped_by_line_timeout"]) == (3, 0)

    uncapped = run(model, path, "-o", tmp_path / "u.jsonl", "-q")  # without the cap: no capped_by anywhere
    assert uncapped.exit_code == 0 and "capped_by" not in (tmp_path / "u.jsonl").read_text()
    assert len(read_jsonl(tmp_path / "u.jsonl")[0]["outputs"][0]["token_ids"]) > 5


def test_max_line_tokens_lets_a_line_fit_a_pool_its_own_limit_does_not(model, tmp_path):
    """The pool check counts the capped length: 4 blocks of 16 hold a 5-token completion, not 120."""
    path = write_jsonl(tmp_path / "f.jsonl", [{"prompt_token_ids": [3, 4], "max_tokens": 120}])
    assert run(model, path, "--num-blocks", "4", "-q").exit_code == 1
    assert "the request may need 8 KV blocks" in read_jsonl(tmp_path / "f.out.jsonl")[0]["error"]
    result = run(model, path, "--num-blocks", "4", "--max-line-tokens", "5", "-q")
    assert result.exit_code == 0, result.output
    assert len(read_jsonl(tmp_path / "f.out.jsonl")[0]["outputs"][0]["token_ids"]) == 5


def test_line_timeout_ends_a_line_at_its_next_token_after_the_timeout(model, tmp_path, monkeypatch):
    """The engine's clock advances 1 s per reading, two readings a step (its start, its end): a line
    admitted in step 1 (at 1 s) has run 5 s > 4.5 s at the end of step 3, so it ends with step 4's token."""
    ticks = iter(range(1, 10_000))
    monkeypatch.setattr("pagedinfer.engine.llm_engine.monotonic", lambda: float(next(ticks)))
    lines = [
        {"id": "long", "messages": [{"role": "user", "content": "To be?"}], "n": 2, "ignore_eos": True},
        {"id": "short", "prompt_token_ids": [3, 4], "max_tokens": 2, "ignore_eos": True},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", lines)
    result = run(model, path, "--line-timeout", "4.5", "-q")
    assert result.exit_code == 0, result.output
    long, short = read_jsonl(tmp_path / "t.out.jsonl")
    assert [(len(o["token_ids"]), o["finish_reason"], o["capped_by"]) for o in long["outputs"]] == [
        (4, "length", "line_timeout")
    ] * 2
    assert short["outputs"][0]["finish_reason"] == "length" and "capped_by" not in short["outputs"][0]
    assert ": 2 ok (1 capped by --line-timeout) · " in " ".join(result.stdout.split())


def test_line_timeout_on_the_real_clock(model, tmp_path):
    """A line that would take 120 steps, with 10 ms: it ends early, and says why."""
    path = write_jsonl(
        tmp_path / "r.jsonl", [{"id": "x", "prompt_token_ids": [3, 4], "max_tokens": 120, "ignore_eos": True}]
    )
    result = run(model, path, "--line-timeout", "0.01", "-q")
    assert result.exit_code == 0, result.output
    (out,) = read_jsonl(tmp_path / "r.out.jsonl")[0]["outputs"]
    assert len(out["token_ids"]) < 120 and (out["finish_reason"], out["capped_by"]) == (
        "length",
        "line_timeout",
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--max-line-tokens", "0"), "--max-line-tokens must be an integer >= 1, not 0"),
        (("--line-timeout", "0"), "--line-timeout must be a number of seconds > 0, not 0.0"),
        (("--line-timeout", "inf"), "--line-timeout must be a number of seconds > 0, not inf"),
        (("--progress-interval", "0"), "--progress-interval takes a number of seconds > 0, not 0.0"),
    ],
)
def test_bad_bounds_are_one_line_errors(model, tmp_path, args, message):
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "x"}])
    one_line_error(run(model, path, *args), message)
    assert not (tmp_path / "e.out.jsonl").exists()


def test_resume_keeps_the_bounds(model, tmp_path):
    lines = [{"id": i, "prompt_token_ids": [3, 4 + i], "max_tokens": 8, "ignore_eos": True} for i in range(3)]
    path = write_jsonl(tmp_path / "k.jsonl", lines)
    out = tmp_path / "k.out.jsonl"
    assert run(model, path, "--max-line-tokens", "4", "-q").exit_code == 0
    out.write_text("".join(out.read_text().splitlines(keepends=True)[:1]))
    one_line_error(
        run(model, path, "--resume", "--max-line-tokens", "5", "-q"),
        f"--resume: {out} was written with --max-line-tokens 4; this run has --max-line-tokens 5",
    )
    assert run(model, path, "--resume", "--max-line-tokens", "4", "-q").exit_code == 0
    assert [len(r["outputs"][0]["token_ids"]) for r in read_jsonl(out)] == [4, 4, 4]


def test_the_python_api_takes_the_same_bounds(model):
    from pagedinfer import LLM, SamplingParams

    llm = LLM(model, device="cpu", max_line_tokens=3)
    params = SamplingParams(max_tokens=None, ignore_eos=True, n=2)
    (out,) = llm.generate(["To be"], params, use_tqdm=False)
    assert [(len(c.token_ids), c.finish_reason, c.capped_by) for c in out.outputs] == [
        (3, "length", "max_line_tokens")
    ] * 2
    (own,) = llm.generate(["To be"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert (len(own.outputs[0].token_ids), own.outputs[0].capped_by) == (2, None)
    with pytest.raises(ValueError, match="line_timeout must be a number of seconds > 0"):
        LLM(model, device="cpu", line_timeout=-1)

"""``--resume`` inside a line: an unfinished line's kept tokens, replayed, continue it to the record an
uninterrupted run writes, byte for byte.

The engine tests capture a request's completions after a few steps (as the journal does), run it again
from them on a fresh engine and compare the whole output's text form (token ids, text, logprob entries
in their order, prompt logprobs, finish and stop reasons). The command-line tests kill ``pagedinfer
run`` (SIGKILL, at random moments and inside the journal's write) and resume until done; their
children are forked from one server process that imported pagedinfer once (a new interpreter per
kill would cost seconds each).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import read_jsonl, write_jsonl
from models import save_text_model

from pagedinfer.cli.line_journal import LineJournal
from pagedinfer.core.sequence import KeptCompletion
from pagedinfer.llm import LLM
from pagedinfer.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
    "required": ["a"],
}
CLI = ["--device", "cpu", "--no-report", "--threads", "1"]  # one thread: no spinning on a busy machine
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def text_llm(text_model) -> LLM:
    return LLM(str(text_model), device="cpu", num_blocks=256)


def kept_of(req) -> dict[int, KeptCompletion]:
    """What the journal keeps of ``req`` now: each completion's tokens and logprob entries."""
    return {
        s.index: KeptCompletion(list(s.output_ids), None if s.logprobs is None else list(s.logprobs))
        for s in req.completions
    }


def run(engine, prompt, params, kept=None, capture_at: int | None = None):
    """``prompt`` alone on ``engine`` to its end (from ``kept``); with ``capture_at``, also what is kept
    once its completions hold that many tokens. Returns (the output's text form, the capture)."""
    prepared = engine.intake.prepare(prompt, params, "r")
    prepared.kept = kept
    req = engine.add_request(prepared, 0)
    captured = None
    while not req.finished:
        engine.step()
        if captured is None and capture_at is not None and req.tokens_so_far() >= capture_at:
            captured = kept_of(req)
    return repr(engine.output(req)), captured


CASES = {
    "greedy": SamplingParams(max_tokens=50, temperature=0, logprobs=2, prompt_logprobs=1),
    "seeded_n4": SamplingParams(max_tokens=50, n=4, seed=11, temperature=0.9, top_p=0.9, logprobs=1),
    "stop_strings": SamplingParams(max_tokens=60, n=4, seed=5, temperature=1.0, stop=["e", "th"], logprobs=0),
    "json_schema": SamplingParams(
        max_tokens=40, n=2, seed=3, temperature=0.8, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    ),
    "penalties": SamplingParams(
        max_tokens=40,
        n=2,
        seed=9,
        temperature=0.7,
        min_tokens=30,
        repetition_penalty=1.3,
        presence_penalty=0.5,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_kept_tokens_replay_to_the_uninterrupted_output(text_llm, case):
    params = CASES[case]
    prompt = "To be, or not to be"
    reference, _ = run(text_llm.engine, prompt, params)
    lengths = []
    for at in (1, 7, 30, 80):
        again, kept = run(text_llm.engine, prompt, params, capture_at=at)
        assert again == reference
        if kept is None:
            continue
        lengths.append(sorted(len(k.token_ids) for k in kept.values()))
        resumed, _ = run(text_llm.engine, prompt, params, kept=kept)
        assert resumed == reference, f"resumed from {at} tokens"
    assert lengths
    if case == "stop_strings":  # a completion that stopped before the capture is replayed to its stop
        assert any(found[0] < found[-1] for found in lengths), lengths


def test_kept_tokens_that_do_not_replay_run_the_line_from_its_prompt(text_llm):
    """A grammar that refuses a kept token, or a token outside the vocabulary: the line runs afresh."""
    params = CASES["json_schema"]
    reference, kept = run(text_llm.engine, "To be", params, capture_at=6)
    counters = text_llm.engine.scheduler.counters
    before = counters.output_tokens_kept
    bad = {i: KeptCompletion([1] + k.token_ids[1:], k.logprobs) for i, k in kept.items()}  # "<eos>" first
    assert run(text_llm.engine, "To be", params, kept=bad)[0] == reference
    outside = {0: KeptCompletion([10**6])}
    assert run(text_llm.engine, "To be", params, kept=outside)[0] == reference
    assert counters.output_tokens_kept == before  # neither was replayed
    assert run(text_llm.engine, "To be", params, kept=kept)[0] == reference
    assert counters.output_tokens_kept == before + sum(len(k.token_ids) for k in kept.values())


def test_speculation_keeps_only_verified_tokens_and_resumes_the_same(text_llm, monkeypatch):
    """With drafts (every third one wrong), what a step boundary shows of a completion is a prefix of
    its final tokens: no unverified draft is ever kept; resuming from it gives the same output."""
    import importlib

    speculative = importlib.import_module("test_speculative")
    prompt = "the quick brown fox jumps over the lazy dog. " * 3
    params = SamplingParams(max_tokens=60, n=2, seed=4, temperature=0.6, logprobs=1)
    off = speculative.engine_view(text_llm, None).engine
    prepared = off.intake.prepare(prompt, params, "r")
    reference_req = off.add_request(prepared, 0)
    while not reference_req.finished:
        off.step()
    reference = repr(off.output(reference_req))
    speculative.oracle_drafts(monkeypatch, [off.output(reference_req)])
    on = speculative.engine_view(text_llm, SPEC).engine
    final = {c.index: c.token_ids for c in off.output(reference_req).outputs}
    req = on.add_request(on.intake.prepare(prompt, params, "r"), 0)
    captures = []
    while not req.finished:
        on.step()
        for found in on.generating().values():
            for s in found.completions:
                assert s.output_ids == final[s.index][: s.num_output_tokens]
            captures.append(kept_of(found))
    assert repr(on.output(req)) == reference
    assert sum(c.accepted for c in on.stats.speculation.sources.values()) > 0  # drafts were taken
    for kept in captures[:: max(1, len(captures) // 4)]:
        assert run(on, prompt, params, kept=kept)[0] == reference


# -- the journal ------------------------------------------------------------------------------------
def test_journal_skips_a_torn_or_corrupted_record_and_keeps_the_finished_lines_apart(text_llm, tmp_path):
    engine = text_llm.engine
    params = SamplingParams(max_tokens=50, n=4, seed=11, temperature=0.9, logprobs=1, ignore_eos=True)
    prepared = engine.intake.prepare("To be", params, "r")
    req = engine.add_request(prepared, 0)
    journal = LineJournal(tmp_path / "o.jsonl.resume.lines", every_tokens=3, every_seconds=1e9)
    journal.start(None)
    for _ in range(10):
        journal.step([("k", req)])
        engine.step()
    journal.step([("k", req)], force=True)
    engine.abort_all()
    whole = journal.load(set())
    assert [len(k.token_ids) for k in whole.lines["k"].completions.values()] == [
        req.completions[0].num_output_tokens
    ] * 4
    assert whole.recomputed == 0
    journal.close()
    data = (tmp_path / "o.jsonl.resume.lines").read_bytes()
    records = data.splitlines(keepends=True)
    # a torn last write: its records are cut, the ones before stand
    (tmp_path / "o.jsonl.resume.lines").write_bytes(b"".join(records[:-4]) + records[-4][:-7])
    torn = LineJournal(tmp_path / "o.jsonl.resume.lines", 3, 1e9).load(set())
    assert [len(k.token_ids) for k in torn.lines["k"].completions.values()] == [9, 9, 9, 9]
    assert torn.recomputed == 4 and torn.most_recomputed == 1  # the reached note says 10 each
    # a flipped byte in a middle record: that completion keeps what came before it
    flipped = bytearray(data)
    at = data.index(b'"i":2,"at":3')
    flipped[at + 20] ^= 1
    (tmp_path / "o.jsonl.resume.lines").write_bytes(bytes(flipped))
    hurt = LineJournal(tmp_path / "o.jsonl.resume.lines", 3, 1e9).load(set())
    assert [len(k.token_ids) for k in hurt.lines["k"].completions.values()] == [10, 10, 3, 10]
    assert LineJournal(tmp_path / "o.jsonl.resume.lines", 3, 1e9).load({"k"}).lines == {}  # done: ignored


# -- the command line, killed --------------------------------------------------------------------------
def _cli_child(args: list[str], env: dict[str, str], log: str) -> None:
    """``pagedinfer ARGS`` in a forked child, its output to ``log``."""
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from pagedinfer.cli.app import app

    try:
        code = app(args, standalone_mode=False)
    except SystemExit as e:
        code = e.code
    os._exit(code if isinstance(code, int) else 0)


class Children:
    """Runs ``pagedinfer`` in children forked from one server that imported pagedinfer and torch."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["torch", "pagedinfer.cli.app", "test_resume_in_line"])

    def start(self, args, log: Path, **env: str) -> multiprocessing.Process:
        child = self.context.Process(target=_cli_child, args=([str(a) for a in args], env, str(log)))
        child.start()
        return child

    def run(self, args, log: Path, **env: str) -> int:
        child = self.start(args, log, **env)
        child.join(600)
        return child.exitcode


@pytest.fixture(scope="module")
def children() -> Children:
    return Children()


def _reached(path: Path) -> int:
    """The fewest tokens a completion of the running line holds, as its note says (0: none yet)."""
    try:
        note = json.loads(path.read_bytes().split(b"\n", 1)[0])
    except (OSError, ValueError):
        return 0
    return min((min(c, default=0) for c in note.values()), default=0) if isinstance(note, dict) else 0


def only(lines: dict):
    """The one line a journal keeps."""
    assert len(lines) == 1, lines
    return next(iter(lines.values()))


def _report(path: Path) -> dict:
    return json.loads(path.read_text())["run"]


def test_kills_inside_the_journal_write_resume_to_the_same_bytes(children, text_model, tmp_path):
    """Greedy, seeded n=4 with logprobs, stop strings and a JSON schema line, killed twice in the middle
    of the journal's write: the resumed output is the uninterrupted run's, byte for byte."""
    lines = [
        {
            "id": "greedy",
            "prompt": "To be",
            "max_tokens": 150,
            "temperature": 0,
            "logprobs": 2,
            "prompt_logprobs": 1,
        },
        {
            "id": "n4",
            "prompt": "Whether",
            "max_tokens": 150,
            "n": 4,
            "seed": 1,
            "temperature": 0.9,
            "logprobs": 1,
        },
        {"id": "stops", "prompt": "The quick", "max_tokens": 150, "n": 4, "seed": 2, "stop": ["ea", "fox"]},
        {
            "id": "json",
            "prompt": "Paged",
            "max_tokens": 120,
            "seed": 3,
            "structured_outputs": {"json": SCHEMA},
        },
    ]
    path = write_jsonl(tmp_path / "j.jsonl", lines)
    base = ["run", path, "--model", text_model, *CLI, "-q", "--resume-every-tokens", "8"]
    log = tmp_path / "log.txt"
    assert children.run([*base, "-o", tmp_path / "ref.jsonl"], log) == 0, log.read_text()
    out = tmp_path / "out.jsonl"
    assert children.run([*base, "-o", out], log, PAGEDINFER_TEST_KILL_IN_RESUME_WRITE="3") == -signal.SIGKILL
    assert children.run([*base, "-o", out, "--resume"], log, PAGEDINFER_TEST_KILL_IN_RESUME_WRITE="4") == -9
    report = tmp_path / "report.json"
    assert children.run([*base, "-o", out, "--resume", "--report-json", report], log) == 0, log.read_text()
    assert out.read_bytes() == (tmp_path / "ref.jsonl").read_bytes()
    run_doc = _report(report)
    assert run_doc["resumed_lines"] >= 1 and run_doc["resumed_tokens_recovered"] >= 8
    assert run_doc["resumed_most_tokens_recomputed"] <= 8
    assert not (tmp_path / "out.jsonl.resume.lines").exists()  # a complete run leaves nothing to resume


def test_ten_kills_of_a_2000_token_line_end_as_an_uninterrupted_run(children, model_root, tmp_path):
    """One line of n=4 seeded completions with logprobs, 2,000 tokens each, killed (SIGKILL) ten times at
    random moments, three of them inside the journal's write, and resumed each time: the final record is
    the uninterrupted run's, and no completion ever has to generate again more than K tokens."""
    model = save_text_model(model_root, positions=2100)
    k = 64
    line = {
        "id": "long",
        "prompt": "To be, or not",
        "max_tokens": 2000,
        "n": 4,
        "seed": 7,
        "temperature": 0.9,
    }
    path = write_jsonl(tmp_path / "l.jsonl", [{**line, "logprobs": 1, "ignore_eos": True}])
    base = ["run", path, "--model", model, *CLI, "-q", "--resume-every-tokens", k]
    log = tmp_path / "log.txt"
    assert children.run([*base, "-o", tmp_path / "ref.jsonl"], log) == 0, log.read_text()
    out = tmp_path / "out.jsonl"
    journal, reached = tmp_path / "out.jsonl.resume.lines", tmp_path / "out.jsonl.resume.reached"
    rng = random.Random(54)
    in_write = set(rng.sample(range(10), 3))
    progress = 0
    for attempt in range(10):
        args = [*base, "-o", out, *(["--resume"] if attempt else [])]
        if attempt in in_write:
            child = children.start(args, log, PAGEDINFER_TEST_KILL_IN_RESUME_WRITE=str(rng.randint(1, 3)))
        else:
            child = children.start(args, log)
            while _reached(reached) < progress + k + 100 and child.exitcode is None:  # generating again
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.1))
            child.kill()
        child.join(600)
        assert child.exitcode == -signal.SIGKILL, f"kill {attempt}: {log.read_text()[-2000:]}"
        found = LineJournal(journal, k, 1e9).load(set())
        kept = [len(c.token_ids) for c in only(found.lines).completions.values()]
        assert len(kept) == 4 and found.most_recomputed <= k, (attempt, kept, found.most_recomputed)
        assert min(kept) >= progress - k  # nothing kept before is lost
        progress = max(progress, min(kept))
    assert 500 < progress < 2000
    report = tmp_path / "report.json"
    assert children.run([*base, "-o", out, "--resume", "--report-json", report], log) == 0, log.read_text()
    assert out.read_bytes() == (tmp_path / "ref.jsonl").read_bytes()
    run_doc = _report(report)
    assert run_doc["resumed_lines"] == 1 and run_doc["resumed_tokens_recovered"] >= 4 * (progress - k)
    assert run_doc["resumed_most_tokens_recomputed"] <= k
    assert len(read_jsonl(out)[0]["outputs"][0]["token_ids"]) == 2000


def test_sigterm_keeps_every_token_and_says_so(children, text_model, tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [{"id": "t", "prompt": "To be", "max_tokens": 200, "n": 2, "seed": 1, "ignore_eos": True}],
    )
    base = ["run", path, "--model", text_model, *CLI, "--progress", "none"]
    log = tmp_path / "log.txt"
    out = tmp_path / "t.out.jsonl"
    child = children.start([*base, "-o", out], log)
    while _reached(tmp_path / "t.out.jsonl.resume.reached") < 20:
        assert child.exitcode is None, log.read_text()
        time.sleep(0.005)
    os.kill(child.pid, signal.SIGTERM)
    child.join(600)
    assert child.exitcode == 143, log.read_text()
    said = " ".join(log.read_text().split())
    kept = LineJournal(tmp_path / "t.out.jsonl.resume.lines", 1, 1e9).load(set())
    tokens = sum(len(c.token_ids) for c in only(kept.lines).completions.values())
    assert 40 <= tokens < 400 and kept.recomputed == 0
    assert f"1 interrupted mid-generation ({tokens:,} tokens generated, all kept for --resume)" in said, said
    log.write_text("")
    assert children.run([*base, "-o", out, "--resume"], log) == 0
    assert children.run([*base, "-o", tmp_path / "ref.jsonl"], log) == 0
    assert out.read_bytes() == (tmp_path / "ref.jsonl").read_bytes()
    assert f"resumed 1 line mid-generation: {tokens:,} tokens recovered, 0 recomputed" in " ".join(
        log.read_text().split()
    )


def test_resume_every_tokens_0_keeps_finished_lines_only(text_model, tmp_path):
    from cli_helpers import invoke

    path = write_jsonl(tmp_path / "z.jsonl", [{"id": "z", "prompt": "To be", "max_tokens": 5}])
    result = invoke("run", path, "--model", text_model, "--device", "cpu", "-q", "--resume-every-tokens", "0")
    assert result.exit_code == 0, result.output
    assert not list(tmp_path.glob("*.lines")) and not list(tmp_path.glob("*.reached"))
    result = invoke(
        "run", path, "--model", text_model, "--device", "cpu", "-q", "--resume-every-tokens", "-1"
    )
    assert (
        result.exit_code == 2
        and "--resume-every-tokens takes a number of tokens (0: off), not -1" in result.output
    )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

"""Reading and validating prompts files, the crash-safe ordered output, the report chart (no model)."""

from __future__ import annotations

import json

import pytest
from cli_helpers import write_jsonl

from pagedinfer.cli.jsonl_output import (
    OutputError,
    OutputFile,
    OutputWriteError,
    StreamOutput,
    default_output_path,
)
from pagedinfer.lines.line import LineError, LineRequest, line_key
from pagedinfer.lines.parse import parse_lines
from pagedinfer.lines.records import record_key
from pagedinfer.lines.source import InputFileError, InputLines
from pagedinfer.seeding import line_seed

DEFAULTS = {"n": 1, "max_tokens": 16, "temperature": 1.0, "stop": []}


def parse(tmp_path, lines, defaults=DEFAULTS):
    return list(parse_lines(InputLines(write_jsonl(tmp_path / "in.jsonl", lines)), defaults, base_seed=0))


def test_every_input_form(tmp_path):
    items = parse(
        tmp_path,
        [
            {"prompt": "hello", "n": 2, "max_tokens": 3, "stop": "x", "id": "a"},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "temperature": 0},
            {"prompt_token_ids": [1, 2, 3], "seed": 5, "logprobs": 1, "max_tokens": None},
            {
                "custom_id": "c1",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "m", "prompt": "p", "max_tokens": 4, "logprobs": 2, "top_p": 0.5},
            },
            {
                "custom_id": "c2",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "m",
                    "messages": [{"role": "user", "content": "q"}],
                    "max_completion_tokens": 7,
                    "logprobs": True,
                    "top_logprobs": 3,
                    "n": 2,
                },
            },
            {"custom_id": "c3", "method": "POST", "url": "/v1/completions", "body": {"prompt": [[4, 5]]}},
        ],
    )
    assert all(isinstance(i, LineRequest) for i in items), [getattr(i, "reason", "") for i in items]
    a, b, c, d, e, f = items
    assert (a.id, a.kind, a.prompt, a.params.n, a.params.max_tokens, a.params.stop) == (
        "a",
        "prompt",
        {"prompt": "hello"},
        2,
        3,
        ["x"],
    )
    assert (b.id, b.kind, b.prompt["messages"][0]["content"], b.params.temperature) == (
        2,
        "messages",
        "hi",
        0,
    )
    assert (c.kind, c.prompt, c.params.seed, c.params.logprobs, c.params.max_tokens) == (
        "prompt_token_ids",
        {"prompt_token_ids": [1, 2, 3]},
        5,
        1,
        None,
    )
    assert d.openai.custom_id == "c1" and not d.openai.chat and d.openai.logprobs_style == "completions"
    assert (d.params.max_tokens, d.params.logprobs, d.params.top_p, d.key) == (4, 2, 0.5, 'custom_id:"c1"')
    assert e.openai.chat and e.openai.logprobs_style == "chat"
    assert (e.params.max_tokens, e.params.logprobs, e.params.n) == (7, 3, 2)
    assert (f.kind, f.prompt) == ("prompt_token_ids", {"prompt_token_ids": [4, 5]})
    # a line without a seed gets one derived from --seed and its identity only
    assert a.params.seed == line_seed(0, 'id:"a"') and b.params.seed == line_seed(0, "line:2")


BAD_LINES = [
    ('{"prompt": "x"', "not valid JSON"),
    ({"max_tokens": 3}, "no prompt"),
    ({"prompt": 42}, "prompt must be a string, not a number"),
    ({"prompt": "x", "temprature": 1}, "unknown field 'temprature'"),
    ({"prompt": "x", "top_p": 2}, "top_p must be in (0, 1]"),
    ({"prompt": "x", "n": "2"}, "n must be an integer, not a string"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens must be an integer or null, not a boolean"),
    ([1, 2], "a line must be a JSON object, not a list"),
    ({"prompt": "x", "messages": []}, "give exactly one of"),
    ({"messages": [{"role": "user"}]}, "messages[0].content must be a string"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "unknown field 'extra'"),
    ({"prompt_token_ids": [1, -2]}, "prompt_token_ids must be a list of non-negative integers"),
    ({"prompt_token_ids": []}, "prompt_token_ids is empty"),
    ({"prompt": "x", "id": [1]}, "id must be a non-empty string or an integer"),
    (
        {"custom_id": "o1", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}},
        "method must be 'POST'",
    ),
    ({"custom_id": "o2", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}, "url must be"),
    (
        {"custom_id": "o3", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "foo": 1}},
        "unknown body field 'foo'",
    ),
    (
        {"custom_id": "o4", "method": "POST", "url": "/v1/completions", "body": {"prompt": ["a", "b"]}},
        "one prompt per line",
    ),
    (
        {"custom_id": "o5", "method": "POST", "url": "/v1/chat/completions", "body": {"prompt": "x"}},
        "takes 'messages'",
    ),
    (
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
        "custom_id must be a non-empty string",
    ),
]


@pytest.mark.parametrize(("line", "reason"), BAD_LINES, ids=[r for _, r in BAD_LINES])
def test_bad_line_gives_a_line_error(tmp_path, line, reason):
    items = parse(tmp_path, [{"prompt": "fine"}, line, {"prompt": "also fine"}])
    assert isinstance(items[0], LineRequest) and isinstance(items[2], LineRequest)
    err = items[1]
    assert isinstance(err, LineError)
    assert reason in err.reason
    assert err.message.startswith("line 2: ")


def test_duplicate_ids_and_blank_lines(tmp_path):
    items = parse(tmp_path, [{"id": "a", "prompt": "x"}, "", "   ", {"id": "a", "prompt": "y"}])
    assert len(items) == 2 and isinstance(items[0], LineRequest)
    assert (
        isinstance(items[1], LineError)
        and items[1].line == 4
        and "duplicate id 'a' (first used on line 1)" in items[1].reason
    )


def test_cli_defaults_are_overridden_per_line(tmp_path):
    defaults = {"n": 3, "max_tokens": 9, "temperature": 0.5, "top_k": 4, "stop": ["zz"]}
    a, b = parse(tmp_path, [{"prompt": "x"}, {"prompt": "y", "n": 1, "stop": None, "top_k": -1}], defaults)
    assert (a.params.n, a.params.max_tokens, a.params.temperature, a.params.top_k, a.params.stop) == (
        3,
        9,
        0.5,
        4,
        ["zz"],
    )
    assert (b.params.n, b.params.top_k, b.params.stop, b.params.max_tokens) == (1, 0, [], 9)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        ("dir", "is a directory"),
        (b"", "is empty"),
        (b"\n  \n", "is empty"),
        ('{"prompt": "x"}\n'.encode("utf-16"), "is UTF-16 or UTF-32 text"),
    ],
)
def test_unusable_input_files(tmp_path, content, message):
    path = tmp_path / "in.jsonl"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(InputFileError, match=message):
        InputLines(path)


def test_a_line_that_is_not_utf8_fails_alone(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n{"prompt": "b"}\n')
    a, bad, b = parse_lines(InputLines(path), DEFAULTS)
    assert isinstance(a, LineRequest) and isinstance(b, LineRequest)
    assert (
        bad.message == "line 2: the line is not UTF-8 text (byte 0xe9 at position 16)" and bad.key == "line:2"
    )


def test_default_output_path(tmp_path):
    assert default_output_path(tmp_path / "prompts.jsonl") == tmp_path / "prompts.out.jsonl"
    assert default_output_path(tmp_path / "p.txt") == tmp_path / "p.txt.out.jsonl"


def test_stdout_output_prints_each_line_once_every_earlier_line_is_done(capsys):
    out = StreamOutput()
    out.write({"id": 2}, 2, "id:2")
    out.write({"id": 1}, 1, "id:1")
    assert capsys.readouterr().out == ""  # held until line 0 is done
    out.write({"id": 0}, 0, "id:0")
    assert [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()] == [0, 1, 2]
    out.write({"id": 4}, 4, "id:4")
    out.flush_held()  # interrupted: finished work is printed rather than lost
    assert capsys.readouterr().out == '{"id": 4}\n' and out.written == 4


def test_output_file_writes_full_lines_and_resume_drops_unreadable_ones(tmp_path):
    path = tmp_path / "out.jsonl"
    out = OutputFile(path)
    out.start(truncate=True)
    out.write({"id": 1, "line": 1, "text": "é"}, 0, "line:1")
    out.write({"custom_id": "c", "id": "batch_req_x"}, 1, 'custom_id:"c"')
    out.sync()
    out.close()
    good = path.read_bytes()
    path.write_bytes(good + b'{"id": 3, "outp')  # a crash mid-write
    out = OutputFile(path)
    done = out.load_done()
    assert (done.keys, done.dropped, done.errors) == ({"line:1", 'custom_id:"c"'}, 1, 0)
    out.close()
    assert path.read_bytes() == good  # the torn line is gone, earlier lines untouched
    lines = good.splitlines(keepends=True)
    path.write_bytes(lines[0] + b"\x00\x00garbage\n" + lines[1] + b"not json\n" + b'{"id": 4}')
    out = OutputFile(path)
    done = out.load_done()
    assert (done.keys, done.dropped) == (
        {"line:1", 'custom_id:"c"', "id:4"},
        2,
    )  # two unreadable middle lines
    out.close()
    assert path.read_bytes() == good + b'{"id": 4}\n'


def test_output_file_is_locked_for_the_run(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": 2}\n{"id": 1}\n')
    first = OutputFile(path)
    with pytest.raises(OutputError, match="locked by another pagedinfer run"):
        OutputFile(path)
    assert path.read_text() == '{"id": 2}\n{"id": 1}\n'  # the second open truncated nothing
    first.load_done()
    assert first.reorder({"id:1": 1, "id:2": 2}.get)  # the file is replaced
    with pytest.raises(OutputError, match="locked"):  # still locked after the file was replaced
        OutputFile(path)
    first.close()
    OutputFile(path).close()


def test_reorder_restores_input_order(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"id": 2}, {"id": 3}, {"id": "x"}, {"id": 1}]))
    ranks = {"id:1": 0, "id:2": 1, "id:3": 2}
    out = OutputFile(path)
    out.load_done()
    assert out.reorder(ranks.get)
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == [1, 2, 3, "x"]  # unknown: last
    assert not out.reorder(ranks.get)  # already in order: untouched
    out.close()
    assert not (tmp_path / "out.jsonl.tmp").exists()


def test_reorder_reads_no_record_back(tmp_path, monkeypatch):
    """Records kept by --resume and records written by this run, in mixed order, put in input order by
    the keys kept as they were read and written: the file is not parsed again."""
    from pagedinfer.cli import jsonl_output

    path = tmp_path / "out.jsonl"
    path.write_text('{"id": 4}\n{"id": 2}\n{"id": "torn')  # two kept records, a torn last line
    out = OutputFile(path)
    assert out.load_done().keys == {"id:4", "id:2"}
    out.start(truncate=False)
    out.write({"id": 3, "text": "é"}, 0, "id:3")
    out.write({"id": 1}, 1, "id:1")
    monkeypatch.setattr(jsonl_output, "_key_of", lambda raw: pytest.fail("a record was read back"))
    assert out.reorder({"id:1": 1, "id:2": 2, "id:3": 3, "id:4": 4}.get)
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == [1, 2, 3, 4]
    out.write({"id": 5}, 2, "id:5")  # after a reorder, the kept offsets are the new file's
    assert not out.reorder({"id:1": 1, "id:2": 2, "id:3": 3, "id:4": 4, "id:5": 5}.get)
    monkeypatch.undo()
    out.close()
    assert OutputFile(path).load_done().keys == {f"id:{i}" for i in range(1, 6)}


def test_a_failed_write_leaves_no_torn_line(tmp_path, monkeypatch):
    import os

    path = tmp_path / "out.jsonl"
    out = OutputFile(path)
    out.start(truncate=True)
    out.write({"id": 1}, 0, "id:1")
    real_write = os.write

    def half_then_full(fd, data):
        real_write(fd, data[:5])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OutputWriteError, match="No space left on device"):
        out.write({"id": 2}, 1, "id:2")
    monkeypatch.undo()
    out.close()
    assert path.read_text() == '{"id": 1}\n' and out.written == 1


def test_one_key_function_for_input_lines_and_output_records():
    assert record_key({"id": 5, "line": 5, "error": "x"}) == line_key(None, 5, 5) == "line:5"
    assert record_key({"id": 3, "line": 1, "error": None}) == line_key(None, 3, 1) == "id:3"
    assert record_key({"id": "3", "line": 1}) == 'id:"3"' != record_key({"id": 3, "line": 1})
    assert record_key({"id": "batch_req_1", "custom_id": "c", "response": None}) == 'custom_id:"c"'
    assert record_key(["not", "a", "record"]) is None


def test_an_explicit_id_never_collides_with_a_line_number(tmp_path):
    items = parse(
        tmp_path, [{"id": 3, "prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}, {"id": 3, "prompt": "d"}]
    )
    assert [type(i).__name__ for i in items] == ["LineRequest"] * 3 + ["LineError"]
    assert "duplicate id 3 (first used on line 1)" in items[3].reason
    assert [i.key for i in items[:3]] == ["id:3", "line:2", "line:3"]


def test_chart_resamples_to_the_width_keeping_peaks():
    from pagedinfer.cli.report import bar_chart, resample

    assert resample([1, 9, 2, 3, 4, 5], 3) == [9, 3, 5]  # max per column
    assert resample([1, 2], 4) == [1, 1, 2, 2]  # short runs are stretched
    top, *_, bottom = bar_chart([0, 4, 8], 3, top=8, rows=2)
    assert top == "  █" and bottom == " ██"

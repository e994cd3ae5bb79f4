"""Reading and validating prompts files, the crash-safe ordered output, the report chart (no model)."""

from __future__ import annotations

import json

import pytest
from cli_helpers import write_jsonl

from pagedinfer.cli.jsonl_input import (
    InputFileError,
    LineError,
    LineRequest,
    derive_seed,
    parse_lines,
    read_input,
)
from pagedinfer.cli.jsonl_output import (
    JsonlSink,
    OrderedWriter,
    default_output_path,
    read_done,
    record_key,
    reorder,
)

DEFAULTS = {"n": 1, "max_tokens": 16, "temperature": 1.0, "stop": []}


def parse(tmp_path, lines, defaults=DEFAULTS):
    return parse_lines(read_input(write_jsonl(tmp_path / "in.jsonl", lines)), defaults, base_seed=0)


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
        "hello",
        2,
        3,
        ["x"],
    )
    assert (b.id, b.kind, b.prompt[0]["content"], b.params.temperature) == (2, "messages", "hi", 0)
    assert (c.kind, c.prompt, c.params.seed, c.params.logprobs, c.params.max_tokens) == (
        "token_ids",
        [1, 2, 3],
        5,
        1,
        None,
    )
    assert d.openai.custom_id == "c1" and not d.openai.chat and d.openai.logprobs_style == "completions"
    assert (d.params.max_tokens, d.params.logprobs, d.params.top_p, d.key) == (4, 2, 0.5, "custom_id:c1")
    assert e.openai.chat and e.openai.logprobs_style == "chat"
    assert (e.params.max_tokens, e.params.logprobs, e.params.n) == (7, 3, 2)
    assert (f.kind, f.prompt) == ("token_ids", [4, 5])
    # a line without a seed gets one derived from --seed and its identity only
    assert a.params.seed == derive_seed(0, "id:a") and b.params.seed == derive_seed(0, "id:2")


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
        (b'{"prompt": "\xff"}\n', "not UTF-8"),
    ],
)
def test_unusable_input_files(tmp_path, content, message):
    path = tmp_path / "in.jsonl"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(InputFileError, match=message):
        read_input(path)


def test_default_output_path(tmp_path):
    assert default_output_path(tmp_path / "prompts.jsonl") == tmp_path / "prompts.out.jsonl"
    assert default_output_path(tmp_path / "p.txt") == tmp_path / "p.txt.out.jsonl"


class ListSink:
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


def test_ordered_writer_writes_each_line_once_every_earlier_line_is_done():
    sink = ListSink()
    writer = OrderedWriter(sink, 4)
    writer.put(2, {"id": 2})
    writer.put(1, {"id": 1})
    assert sink.records == []  # held until line 0 is done
    writer.put(0, {"id": 0})
    assert [r["id"] for r in sink.records] == [0, 1, 2]  # written at once, in input order
    assert not writer.done
    writer.put(3, {"id": 3})
    assert writer.done and [r["id"] for r in sink.records] == [0, 1, 2, 3]


def test_flush_held_keeps_finished_work():
    sink = ListSink()
    writer = OrderedWriter(sink, 3)
    writer.put(2, {"id": 2})
    assert writer.flush_held() == 1 and sink.records == [{"id": 2}]


def test_sink_appends_full_lines_and_resume_truncates_a_torn_last_line(tmp_path):
    path = tmp_path / "out.jsonl"
    sink = JsonlSink(path, truncate=True)
    sink.write({"id": 1, "text": "é"})
    sink.write({"custom_id": "c", "id": "batch_req_x"})
    sink.close()
    good = path.read_bytes()
    path.write_bytes(good + b'{"id": 3, "outp')  # a crash mid-write
    assert read_done(path) == ["id:1", "custom_id:c"]
    assert path.read_bytes() == good  # the torn line is gone, earlier lines untouched
    path.write_bytes(good + b"not json\n" + b'{"id": 4}')  # a complete last record without its newline
    assert read_done(path) == ["id:1", "custom_id:c", "id:4"]
    assert path.read_bytes().endswith(b'{"id": 4}\n')


def test_reorder_restores_input_order(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"id": 2}, {"id": 3}, {"id": 1}]))
    assert reorder(path, {"id:1": 0, "id:2": 1, "id:3": 2})
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == [1, 2, 3]
    assert not reorder(path, {"id:1": 0, "id:2": 1, "id:3": 2})  # already in order: untouched


def test_record_key_matches_line_key():
    assert record_key({"id": 5, "line": 5, "error": "x"}) == "id:5"
    assert record_key({"id": "batch_req_1", "custom_id": "c", "response": None}) == "custom_id:c"


def test_chart_resamples_to_the_width_keeping_peaks():
    from pagedinfer.cli.report import bar_chart, resample

    assert resample([1, 9, 2, 3, 4, 5], 3) == [9, 3, 5]  # max per column
    assert resample([1, 2], 4) == [1, 1, 2, 2]  # short runs are stretched
    top, *_, bottom = bar_chart([0, 4, 8], 3, top=8, rows=2)
    assert top == "  █" and bottom == " ██"
